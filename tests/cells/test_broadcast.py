"""Weight sync inside a job (``CellJobConfig.weight_sync``, ``cells/broadcast.py``): a step's
weights go from the Learner that applied it to the runners of the cells not training, in
buckets over a gloo group, on a real local Ray; each rollout cell hosts 2 engines
(``EngineLayout``)."""

from __future__ import annotations

import dataclasses
import os
import tempfile

import pytest
import torch

from ray_xlong.cells.broadcast import SCHEMES
from ray_xlong.cells.config import CellJobConfig, LearnerSettings, make_policy
from ray_xlong.cells.engines import EngineLayout, replicated_engine_set
from ray_xlong.cells.pool import create_cells
from ray_xlong.cells.sharding import ShardingSettings
from ray_xlong.scheduling import Role, SchedulingConfig

from tests.cells.test_sharded_modes import config as sharded_config

JOB = SchedulingConfig(total_steps=3, batch_groups=1, runs_per_group=2, staleness_bound=1)


def config(model_dir: str, **kwargs) -> CellJobConfig:
    """The 2-cell elastic job of ``test_sharded_modes`` with one Learner per cell, 3 steps of one
    group each, lr 1e-3 (visible updates)."""
    fields = {"job": JOB, "sharding": ShardingSettings(),
              "learner": LearnerSettings(model_dir=model_dir, lr=1e-3), **kwargs}
    return dataclasses.replace(sharded_config(model_dir), **fields)


def test_weight_sync_default_and_bad_values(tmp_path):
    assert SCHEMES == ("object_store", "broadcast")
    cpu = config(str(tmp_path))
    assert cpu.weight_sync is None and cpu.weight_sync_scheme == "object_store"
    cuda = config(str(tmp_path), sharding=ShardingSettings(device="cuda"))
    assert cuda.weight_sync_scheme == "broadcast"
    assert config(str(tmp_path), weight_sync="object_store",
                  sharding=ShardingSettings(device="cuda")).weight_sync_scheme == "object_store"
    with pytest.raises(ValueError, match="CellJobConfig.weight_sync must be one of"):
        config(str(tmp_path), weight_sync="nccl")
    with pytest.raises(ValueError, match="CellJobConfig.weight_sync_timeout_s must be > 0"):
        config(str(tmp_path), weight_sync_timeout_s=0)


@pytest.fixture(scope="module")
def cells(tmp_path_factory):
    """A local Ray and 2 cells, each runner an EngineSet of 2 oracle engines (model logprobs)."""
    import ray

    from ray_xlong.models import build_tiny_model_dir
    from ray_xlong.rllib.cell_actors import cell_actors
    from ray_xlong.tools.driver import rollout_config

    os.environ["RAY_TMPDIR"] = tempfile.mkdtemp(prefix="rx", dir="/tmp")
    ray.init(num_cpus=2, num_gpus=2, include_dashboard=False,
             object_store_memory=300 * 1024 ** 2)
    try:
        model_dir = str(build_tiny_model_dir(tmp_path_factory.mktemp("bc") / "m", seed=0))
        cfg = config(model_dir, spool_dir=str(tmp_path_factory.mktemp("spool")))
        rollout = rollout_config(cfg)
        rollout = dataclasses.replace(rollout, engine_factory=replicated_engine_set(
            EngineLayout(engines_per_cell=2), rollout.engine_factory))
        actors = cell_actors(rollout=rollout, learner=cfg.learner, processor=cfg.processor,
                             tasks=cfg.work.tasks(), seed=cfg.work.seed, spool_dir=cfg.spool_dir)
        pool = create_cells(cfg.layout, actors=actors)
        yield cfg, pool
        pool.shutdown()
    finally:
        ray.shutdown()


def run(cfg, pool, actuator_class=None):
    from ray_xlong.cells.actuator import RayActuator

    act = (actuator_class or RayActuator)(cfg, make_policy(cfg), pool)
    return act, act.run()


def final_weights(act) -> dict[str, torch.Tensor]:
    import ray

    return ray.get(act.learners.weights_ref)


@pytest.mark.ray
@pytest.mark.slow
def test_broadcast_job_puts_the_learners_weights_into_every_engine(cells):
    """The same elastic job twice on the same cells: object store, then broadcast. Every
    engine of every cell the last step pushed to holds the Learner's weights bitwise (both
    engines of the cell), no push fell back, and both jobs train the same runs per step to
    the same weights (measured bitwise; to 1e-6, a step's updates are ~1e-3)."""
    import ray

    from ray_xlong.tools.faults import audit

    cfg, pool = cells
    store_act, store = run(dataclasses.replace(cfg, weight_sync="object_store"), pool)
    act, result = run(dataclasses.replace(cfg, weight_sync="broadcast"), pool)
    assert store_act.sync is None and act.sync is not None
    assert act.sync.groups_made and act.sync.failures == 0
    fallbacks = result.timings["broadcast_fallbacks"]      # one entry per push with targets
    assert fallbacks and sum(fallbacks) == 0
    want = final_weights(act)
    pushed = [c for c, role in enumerate(act.m.role) if role is not Role.TRAINING]
    assert pushed, "the last step pushed to no cell"
    for c in pushed:
        engines = ray.get(pool.cells[c].runner.engine_weights.remote())
        assert len(engines) == 2
        for got in engines:
            assert list(got) == list(want)
            assert all(torch.equal(got[k], want[k]) for k in want), f"cell {c}"
    for r in (store, result):
        a = audit(r, JOB)
        assert (a.runs_lost, a.runs_trained_twice, a.steps) == (0, 0, JOB.total_steps)
        assert a.violations == ()
    assert [sorted(s) for s in store.trained_runs] == [sorted(s) for s in result.trained_runs]
    other, start = final_weights(store_act), ray.get(pool.initial_weights)
    assert max((want[k] - start[k]).abs().max().item() for k in want) > 1e-4   # it trained
    for k in want:     # measured bitwise equal; the tolerance allows another reduction order
        torch.testing.assert_close(want[k], other[k], rtol=0, atol=1e-6)


@pytest.mark.ray
@pytest.mark.slow
def test_a_runner_killed_at_a_sync_loses_nothing(cells):
    """A target's runner is killed just before the first broadcast: the sender's group
    rendezvous times out (``weight_sync_timeout_s``), the job does not hang, the cell is rebuilt
    on the current weights, the next push makes a new group, and no run is lost or trained
    twice."""
    import ray

    from ray_xlong.cells.actuator import RayActuator
    from ray_xlong.tools.faults import audit

    class KillAtSync(RayActuator):
        killed: list[int] = []

        def _push_weights(self):
            targets = [c for c, role in enumerate(self.m.role) if role is not Role.TRAINING]
            if targets and not self.killed:
                self.killed.append(targets[0])
                ray.kill(self.cells[targets[0]].runner, no_restart=True)
            return super()._push_weights()

    cfg, pool = cells
    replaced = pool.actors_replaced
    act, result = run(dataclasses.replace(cfg, weight_sync="broadcast",
                                          weight_sync_timeout_s=5.0), pool, KillAtSync)
    assert KillAtSync.killed, "no push had a target"
    assert act.sync.failures >= 1 and pool.actors_replaced > replaced
    assert [f.kind for f in result.faults if f.cell == KillAtSync.killed[0]] == ["runner"]
    a = audit(result, JOB)
    assert (a.runs_lost, a.runs_trained_twice, a.steps) == (0, 0, JOB.total_steps)
    assert a.violations == ()
    want = final_weights(act)
    for c, role in enumerate(act.m.role):
        if role is not Role.TRAINING:
            for got in ray.get(pool.cells[c].runner.engine_weights.remote()):
                assert all(torch.equal(got[k], want[k]) for k in want), f"cell {c}"
