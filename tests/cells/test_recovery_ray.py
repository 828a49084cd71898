"""Every holder of the state lost, on real cells (one local Ray node, 2 cells, real
``XLongLearner`` actors): the group keeps no copy in the driver (the seam the per-step durable
copy left); at version 3 every Learner holding it is killed; a new Learner
loads the last checkpoint (version 2, a DCP checkpoint its Learner wrote in the background) and
replays step 2 → 3 from the spool, ending on the lost weights (to float tolerance: one Learner
sums what two did), and the job ends with every run trained once."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch

from ray_xlong.cells.config import CellJobConfig, LearnerSettings, make_policy
from ray_xlong.cells.actuator import RayActuator
from ray_xlong.cells.long_horizon_job import LongHorizonJob
from ray_xlong.cells.metrics import check_invariants
from ray_xlong.cells.layout import CellLayout
from ray_xlong.cells.runs import run_key
from ray_xlong.cells.shard_checkpoint import latest
from ray_xlong.models import build_tiny_model_dir
from ray_xlong.rollout import HarnessConfig
from ray_xlong.rollout.tasks import LongHorizonConfig
from ray_xlong.scheduling import SchedulingConfig

JOB = SchedulingConfig(total_steps=4, batch_groups=2, runs_per_group=2, staleness_bound=1)


@pytest.mark.ray
@pytest.mark.slow
def test_every_holder_lost_on_real_cells_reloads_and_replays(tmp_path):
    import ray

    from ray_xlong.jobs.driver import start_cells

    os.environ["RAY_TMPDIR"] = tempfile.mkdtemp(prefix="rx", dir="/tmp")
    ray.init(num_cpus=2, num_gpus=2, include_dashboard=False, log_to_driver=False,
             object_store_memory=200 * 1024 ** 2)
    try:
        model_dir = str(build_tiny_model_dir(tmp_path / "m", seed=0))
        cfg = CellJobConfig(
            mode="elastic", job=JOB,
            layout=CellLayout(cells=2, nodes_per_cell=1, gpus_per_node=1, cpus_per_bundle=1.0,
                              strategy="PACK"),
            learner=LearnerSettings(model_dir=model_dir, lr=1e-3), slots_per_cell=2,
            work=LongHorizonJob(task=LongHorizonConfig(num_steps=3, latency_median_s=900.0,
                                                       latency_sigma=0.8, time_scale=1 / 3600),
                                seed=3),
            harness=HarnessConfig(max_new_tokens=16, wall_clock_s=5.0, tool_timeout_s=5.0),
            spool_dir=str(tmp_path / "spool"), checkpoint_dir=str(tmp_path / "ckpt"),
            checkpoint_every=2)
        pool = start_cells(cfg)
        act = RayActuator(cfg, make_policy(cfg), pool)
        seen: dict = {}

        class LoseEveryHolder:
            def tick(self, a):
                g = a.learners
                if seen or g is None or g.version != 3:
                    return
                done = latest(cfg.checkpoint_dir)
                if done is None or done[0] != 2:
                    return
                seen["lost"] = ray.get(g.state_ref)["weights"]
                g.kept = None
                holders = a.recovery.holders()
                for c in holders:
                    ray.kill(g.learners[c], no_restart=True)
                seen["holders"] = holders

        reload = act.recovery.reload_checkpoint

        def reload_and_look(*args, **kwargs):
            out = reload(*args, **kwargs)
            seen["replayed"] = ray.get(act.learners.state_ref)["weights"]
            return out

        act.recovery.reload_checkpoint = reload_and_look
        act.injector = LoseEveryHolder()
        result = act.run()
        pool.shutdown()
    finally:
        ray.shutdown()
    assert seen.get("holders"), "version 3 passed before checkpoint 2 was on disk"
    (state,) = [f for f in result.faults if f.kind == "state"]
    assert "reloaded version 2, replayed 1 steps" in state.why
    for k, v in seen["lost"].items():
        torch.testing.assert_close(seen["replayed"][k], v, rtol=1e-4, atol=1e-5)
    assert check_invariants(result, staleness_bound=1) == []
    every = [r for step in result.trained_runs for r in step]
    assert sorted(every) == sorted(run_key(r) for r in range(JOB.total_runs))
