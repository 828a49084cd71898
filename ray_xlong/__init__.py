"""ray_xlong: long-horizon LLM agent RL on Ray RLlib.

Two ideas carry the package (see ``docs/design.md``):

* **Elastic cells** — placement-group cells that switch between serving agent runs and training,
  each on its own, never interrupting a live run (``ray_xlong.scheduling``, ``ray_xlong.sim``,
  ``ray_xlong.rllib``).
* **The trajectory processor** — token-exact model-call records, a prefix tree per run, count-once
  loss on model-generated tokens, at most K trajectories per run (``ray_xlong.trajectory``).

Layers import only downwards; ``trajectory``, ``scheduling`` and ``sim`` are pure (no ray, no vllm).
"""

__version__ = "0.1.0"


def enable(config, *, ignore=(), **xlong_options):
    """Turn an existing RLlib ``AlgorithmConfig`` into an ``XLongConfig`` keeping its settings.

    See :func:`ray_xlong.rllib.enable.enable` (imported on first call: ``import ray_xlong``
    does not import ray).
    """
    from ray_xlong.rllib.enable import enable as _enable

    return _enable(config, ignore=ignore, **xlong_options)


__all__ = ["__version__", "enable"]
