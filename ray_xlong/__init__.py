"""ray_xlong: long-horizon LLM agent RL on Ray RLlib.

Two ideas carry the package (see ``../shared/DESIGN.md``):

* **Elastic cells** — placement-group cells that switch between serving agent runs and training,
  each on its own, never interrupting a live run (``ray_xlong.scheduling``, ``ray_xlong.sim``,
  ``ray_xlong.rllib``).
* **The trajectory processor** — token-exact model-call records, a prefix tree per run, count-once
  loss on model-generated tokens, at most K trajectories per run (``ray_xlong.trajectory``).

Layers import only downwards; ``trajectory``, ``scheduling`` and ``sim`` are pure (no ray, no vllm).
"""

__version__ = "0.1.0"
