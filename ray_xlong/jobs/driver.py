"""Top-level driver: cells up once, then a job per mode on the same cells.

```
pool = start_cells(config)                     placement groups + runner/learner actors
result = run_job(config, pool)                 policy of config.mode drives the actuator
check_invariants(result, staleness_bound=b)    the event log obeys the cell invariants
pool.shutdown()
```
``python -m ray_xlong.jobs.driver`` runs a small elastic job on a local Ray and prints its
summary.
"""

from __future__ import annotations

import dataclasses

from ray_xlong.cells.actuator import RayActuator
from ray_xlong.cells.pool import CellPool, create_cells
from ray_xlong.cells.config import CellJobConfig, make_policy
from ray_xlong.rllib.cell_actors import cell_actors
from ray_xlong.rllib.env_runner import RolloutConfig
from ray_xlong.cells.metrics import RayResult, check_invariants


def rollout_config(config: CellJobConfig) -> RolloutConfig:
    """What each cell's runner hosts: the job's oracle engine on the learner's model."""
    model_dir = config.learner.model_dir
    return RolloutConfig(model_dir=model_dir, harness=config.harness,
                         max_batch_size=max(config.slots_per_cell, 1),
                         dtype=config.learner.dtype,
                         engine_factory=config.work.engine_factory(model_dir))


def start_cells(config: CellJobConfig) -> CellPool:
    """Create the cells of ``config.layout`` on the connected Ray cluster (once per process)."""
    actors = cell_actors(rollout=rollout_config(config), learner=config.learner,
                         processor=config.processor, tasks=config.work.tasks(),
                         seed=config.work.seed,
                         spool_dir=config.spool_dir, sharding=config.sharding)
    return create_cells(config.layout, actors=actors)


def run_job(config: CellJobConfig, pool: CellPool) -> RayResult:
    """Run ``config``'s job in ``config.mode`` on ``pool`` (reset to version 0 first)."""
    return RayActuator(config, make_policy(config), pool).run()


def main() -> None:  # pragma: no cover - demo
    import os
    import tempfile

    import ray

    from ray_xlong.cells.ray_edge import KEEP_TASK_WORKERS
    from ray_xlong.models import build_tiny_model_dir
    from ray_xlong.cells.layout import CellLayout
    from ray_xlong.cells.config import LearnerSettings
    from ray_xlong.scheduling import SchedulingConfig

    tmp = tempfile.mkdtemp(prefix="rx", dir="/tmp")
    os.environ.setdefault("RAY_TMPDIR", tmp)
    ray.init(num_cpus=2, num_gpus=2, include_dashboard=False, _system_config=KEEP_TASK_WORKERS)
    model_dir = str(build_tiny_model_dir(os.path.join(tmp, "m"), seed=0))
    config = CellJobConfig(mode="elastic", job=SchedulingConfig(2, 2, 2, 1),
                         layout=CellLayout(cells=2, cpus_per_bundle=1.0),
                         learner=LearnerSettings(model_dir=model_dir), slots_per_cell=2)
    pool = start_cells(config)
    try:
        result = run_job(config, pool)
        print(f"{result.mode}: makespan {result.makespan_s:.2f} s, busy "
              f"{result.gpu_busy_frac:.2f}, violations "
              f"{check_invariants(result, staleness_bound=config.job.staleness_bound)}")
        print(dataclasses.asdict(result)["timings"])
    finally:
        pool.shutdown()
        ray.shutdown()


if __name__ == "__main__":  # pragma: no cover
    main()
