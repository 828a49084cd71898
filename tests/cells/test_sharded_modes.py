"""Multi-rank cells under the actuator: 2 cells whose Learner is a 2-rank FSDP2 cell (gloo),
one Ray node; colocated and elastic jobs keep the cell invariants (no cell left rollout with a
live run, runs stayed on their cell, staleness <= bound, every ended run trained once)."""

from __future__ import annotations

import dataclasses
import os
import tempfile
import time

import pytest

from ray_xlong.cells.config import CellJobConfig, LearnerSettings
from ray_xlong.cells.long_horizon_job import LongHorizonJob
from ray_xlong.cells.metrics import check_invariants
from ray_xlong.cells.layout import CellLayout
from ray_xlong.cells.sharded_cell import ShardedCell
from ray_xlong.cells.sharding import ShardingError, ShardingSettings
from ray_xlong.models import build_tiny_model_dir
from ray_xlong.rollout import HarnessConfig
from ray_xlong.rollout.tasks import LongHorizonConfig
from ray_xlong.scheduling import SchedulingConfig
from ray_xlong.jobs.driver import run_job, start_cells

JOB = SchedulingConfig(total_steps=2, batch_groups=2, runs_per_group=2, staleness_bound=1)
WORK = LongHorizonJob(task=LongHorizonConfig(num_steps=3, latency_median_s=900.0,
                                             latency_sigma=0.8, time_scale=1 / 3600), seed=3)
LAYOUT = CellLayout(cells=2, nodes_per_cell=1, gpus_per_node=1, cpus_per_bundle=1.0,
                    strategy="PACK")


def config(model_dir: str, **kwargs) -> CellJobConfig:
    return CellJobConfig(mode="elastic", job=JOB, layout=LAYOUT,
                         learner=LearnerSettings(model_dir=model_dir, lr=1e-4), slots_per_cell=2,
                         work=WORK, sharding=ShardingSettings(ranks_per_cell=2),
                         harness=HarnessConfig(max_new_tokens=32, wall_clock_s=2.5,
                                               tool_timeout_s=2.5), **kwargs)


def test_cuda_ranks_on_cells_without_gpus_fail_before_anything_starts(tmp_path):
    with pytest.raises(ShardingError, match=r"ShardingSettings.device='cuda'"):
        CellJobConfig(mode="elastic", job=JOB, layout=dataclasses.replace(LAYOUT, gpus_per_node=0),
                      learner=LearnerSettings(model_dir=str(tmp_path)),
                      sharding=ShardingSettings(ranks_per_cell=2, device="cuda"))


@pytest.fixture(scope="module")
def ray_2gpus(tmp_path_factory):
    """One local Ray with 2 logical GPUs (no CUDA) for the module, and a tiny model."""
    import ray

    os.environ["RAY_TMPDIR"] = tempfile.mkdtemp(prefix="rx", dir="/tmp")
    ray.init(num_cpus=2, num_gpus=2, include_dashboard=False,
             object_store_memory=300 * 1024 ** 2)
    try:
        yield str(build_tiny_model_dir(tmp_path_factory.mktemp("sm") / "m", seed=0))
    finally:
        ray.shutdown()


@pytest.mark.ray
@pytest.mark.slow
def test_cuda_on_logical_gpus_is_an_error_before_any_actor_starts(ray_2gpus):
    """Logical GPUs (``ray.init(num_gpus=2)``, no CUDA): a config asking for CUDA learners
    fails in ``create_cells`` naming the field, from the probe of bundle 0 — no runner or
    learner was started (no NCCL tried) and the placement groups are gone."""
    import ray
    from ray.util import placement_group_table

    before = set(placement_group_table())
    gpus = ray.available_resources().get("GPU")
    cfg = dataclasses.replace(config(ray_2gpus),
                              sharding=ShardingSettings(ranks_per_cell=1, device="cuda"))
    with pytest.raises(ShardingError, match=r"ShardingSettings.device='cuda'.*CUDA devices"):
        start_cells(cfg)
    states = {t["state"] for k, t in placement_group_table().items() if k not in before}
    assert states <= {"REMOVED"}, states
    deadline = time.monotonic() + 30     # a removed group's resources return async
    while ray.available_resources().get("GPU") != gpus and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ray.available_resources().get("GPU") == gpus


@pytest.fixture(scope="module")
def sharded_pool(ray_2gpus):
    """One pool of 2 cells of 2 ranks for both modes, on the module's Ray: ``run_job`` resets
    the pool to version 0 before each job (a mode and a weight sync are the job's, not the
    pool's)."""
    cfg = config(ray_2gpus)
    pool = start_cells(cfg)
    try:
        assert all(isinstance(c.learner, ShardedCell) and len(c.learner) == 2
                   for c in pool.cells)
        yield cfg, pool
    finally:
        pool.shutdown()


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.parametrize("mode,weight_sync", [("colocated", "object_store"),
                                              ("elastic", "broadcast")])
def test_modes_keep_the_cell_invariants_with_2_rank_cells(sharded_pool, mode, weight_sync):
    """Elastic: each step's weights leave the sharded cell's rank 0 by broadcast (gloo)."""
    base, pool = sharded_pool
    cfg = dataclasses.replace(base, mode=mode, weight_sync=weight_sync)
    result = run_job(cfg, pool)
    assert check_invariants(result, staleness_bound=JOB.staleness_bound) == []
    assert [e.kind for e in result.events].count("step_ended") == JOB.total_steps
    pushes = result.timings.get("broadcast_fallbacks", ())
    assert (len(pushes) >= 1 and sum(pushes) == 0) if weight_sync == "broadcast" \
        else pushes == ()
