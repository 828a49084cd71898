"""The cell runtime on Ray: cells as placement groups, the actuator that applies a scheduling
policy's moves to them, the elastic learner group, the run spool, recovery and checkpoints.

What lives here: ``pool`` (layout, placement groups, actor start/replace), ``actuator`` /
``stepping`` (the Ray twin of the simulator: a whole job, or one optimizer step per call),
``learner_group`` (cells join a step between micro-batches), ``spool`` (ended runs on disk),
``config`` (``CellJobConfig``), ``metrics`` (``RayResult``), the work sources ``task_job`` and
``long_horizon_job``.

May import: ray (not ``ray.rllib``), torch, and the lower layers ``trajectory``,
``scheduling``, ``sim``, ``rollout``, ``models``. The RLlib adapter (``ray_xlong.rllib``) sits
above and hands in the actor classes a cell hosts; nothing here imports it
(``tests/test_layers.py``).
"""
