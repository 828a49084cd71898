"""Weight sync inside a job (``CellJobConfig.weight_sync``, ``cells/broadcast.py``): a step's
weights go from the Learner that applied it to the runners of the cells not training, in
buckets over a gloo group, on a real local Ray with logical GPUs; each rollout cell hosts 2
engines, each its own actor holding one of the cell's 2 GPUs (``EngineLayout(placement=
'actors')``, ``cells/engine_actors.py``: these tests are also that module's Ray tests, on one
pool to save CI time)."""

from __future__ import annotations

import dataclasses
import os
import tempfile
import time

import pytest
import torch

from ray_xlong.cells.broadcast import SCHEMES
from ray_xlong.cells.config import CellJobConfig, LearnerSettings, make_policy
from ray_xlong.cells.cell_engines import replicated_engine_set
from ray_xlong.cells.engines import EngineLayout
from ray_xlong.cells.layout import CellLayout
from ray_xlong.cells.pool import create_cells
from ray_xlong.cells.sharding import ShardingSettings
from ray_xlong.scheduling import Role, SchedulingConfig

from tests.cells.test_sharded_modes import config as sharded_config

JOB = SchedulingConfig(total_steps=3, batch_groups=1, runs_per_group=2, staleness_bound=1)
LAYOUT = CellLayout(cells=2, nodes_per_cell=1, gpus_per_node=2, cpus_per_bundle=1.0,
                    strategy="PACK")
"""2 cells of 2 logical GPUs: one per engine actor."""


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
    """A local Ray with 4 logical GPUs and 2 cells of 2, each runner with 2 engine actors of
    the job's oracle engine (model logprobs)."""
    import ray

    from ray_xlong.models import build_tiny_model_dir
    from ray_xlong.rllib.cell_actors import cell_actors
    from ray_xlong.jobs.driver import rollout_config

    os.environ["RAY_TMPDIR"] = tempfile.mkdtemp(prefix="rx", dir="/tmp")
    ray.init(num_cpus=2, num_gpus=4, include_dashboard=False,
             object_store_memory=300 * 1024 ** 2)
    try:
        model_dir = str(build_tiny_model_dir(tmp_path_factory.mktemp("bc") / "m", seed=0))
        cfg = config(model_dir, layout=LAYOUT, spool_dir=str(tmp_path_factory.mktemp("spool")))
        rollout = rollout_config(cfg)
        rollout = dataclasses.replace(rollout, engine_factory=replicated_engine_set(
            EngineLayout(engines_per_cell=2, placement="actors"), rollout.engine_factory))
        actors = cell_actors(rollout=rollout, learner=cfg.learner, processor=cfg.processor,
                             tasks=cfg.work.tasks(), seed=cfg.work.seed, spool_dir=cfg.spool_dir)
        assert actors.engine_actors
        pool = create_cells(cfg.layout, actors=actors)
        yield cfg, pool
        pool.shutdown()
    finally:
        ray.shutdown()


def routing(pool, cell):
    """Cell ``cell``'s ``EngineRouting`` (runs per engine actor, handles, GPUs)."""
    import ray

    return ray.get(pool.cells[cell].runner.engine_routing.remote())


def engines_hold(pool, cell, want) -> bool:
    """Whether both engines of ``cell`` hold ``want`` bitwise."""
    import ray

    got = ray.get(pool.cells[cell].runner.engine_weights.remote())
    assert len(got) == 2
    return all(list(g) == list(want) and all(torch.equal(g[k], want[k]) for k in want)
               for g in got)


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.serial
def test_engine_actors_hold_their_own_gpus_and_runs_stay_on_theirs(cells):
    """Each engine actor holds one distinct logical GPU, set as its ``CUDA_VISIBLE_DEVICES``, in
    its own process (4 actors of 1 GPU fit the 2 × 2 GPUs beside the runners: the runners hold
    none). Engine actor i of cell 0 is set to policy version 10 + i, so every model call's
    version names the actor that served it: 4 runs started at once split 2 + 2 and each run's
    calls all carry one version. With live runs the cell refuses to leave rollout; empty, it
    may. (The jobs below reset the engines to version 0.)"""
    import ray

    cfg, pool = cells
    infos = [i for c in range(LAYOUT.cells) for i in routing(pool, c).infos]
    assert len(infos) == 4
    assert all(len(i.gpu_ids) == 1 for i in infos)
    assert len({i.gpu_ids[0] for i in infos}) == 4
    assert all(i.visible_devices == i.gpu_ids[0] for i in infos)
    assert len({i.pid for i in infos}) == 4

    runner, actors = pool.cells[0].runner, routing(pool, 0).actors
    ray.get([a.update_weights.remote(pool.initial_weights, 10 + i)
             for i, a in enumerate(actors)])
    served = [ray.get(a.stats.remote()).requests for a in actors]
    ray.get(runner.start_runs.remote([cfg.work.spec(900 + r, runs_per_group=1)
                                      for r in range(4)]))
    deadline = time.monotonic() + 30                  # a run is pinned at its first call
    while sum(routing(pool, 0).live_runs) < 4 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert routing(pool, 0).live_runs == (2, 2)
    with pytest.raises(ray.exceptions.RayTaskError, match="live runs"):
        ray.get(runner.suspend.remote())              # drains, then refuses to sleep
    results, deadline = [], time.monotonic() + 120
    while len(results) < 4 and time.monotonic() < deadline:
        results += ray.get(runner.sample_results.remote())
        time.sleep(0.1)
    assert len(results) == 4
    versions = {r.run.run_id: {c.policy_version for c in r.run.calls} for r in results}
    assert all(len(v) == 1 for v in versions.values()), versions     # one engine per run
    assert sorted(v for vs in versions.values() for v in vs) == [10, 10, 11, 11]
    calls = [sum(len(r.run.calls) for r in results if r.run.calls[0].policy_version == 10 + i)
             for i in range(2)]
    assert [ray.get(a.stats.remote()).requests - s for a, s in zip(actors, served)] == calls
    assert routing(pool, 0).runs_served == (2, 2) and routing(pool, 0).live_runs == (0, 0)
    ray.get(runner.suspend.remote())                  # empty: it may leave rollout
    ray.get(runner.resume.remote(None, 0))


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.serial
def test_an_engine_layout_that_does_not_divide_the_cell_fails_before_anything_starts(cells):
    """3 engine actors on a cell of 2 GPUs: ``create_cells`` refuses, naming the numbers, and
    creates no placement group."""
    from ray.util import placement_group_table

    from ray_xlong.cells.engines import EngineLayoutError
    from ray_xlong.cells.pool import CellActors

    actors = CellActors(runner_class=object, runner_kwargs={}, learner_class=object,
                        learner_kwargs={}, engines=EngineLayout(engines_per_cell=3,
                                                                placement="actors"))
    groups = len(placement_group_table())
    with pytest.raises(EngineLayoutError, match=r"engines_per_cell=3 .* the cell's 2 GPUs"):
        create_cells(LAYOUT, actors=actors)
    assert len(placement_group_table()) == groups


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.serial
def test_a_lost_engine_actor_takes_its_runner_down_and_the_cell_is_rebuilt(cells):
    """Engine actor 1 of cell 0 is killed; the next run pinned to it finds it dead and the
    runner exits (recovery's runner loss), taking engine actor 0 with it; the cell's runner is
    rebuilt (``CellPool.replace``, what ``recovery.py`` calls) with two new engine actors that
    serve runs again."""
    import ray

    cfg, pool = cells
    old = routing(pool, 0)
    ray.kill(old.actors[1], no_restart=True)
    runner = pool.cells[0].runner
    with pytest.raises(ray.exceptions.RayActorError):   # the runner goes down: as soon as a
        # call reaches the dead actor, which on a loaded machine may already be before these
        # runs start (start_runs then fails with the runner's death)
        ray.get(runner.start_runs.remote([cfg.work.spec(950 + r, runs_per_group=1)
                                          for r in range(2)]))  # pinned one to each actor
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            ray.get(runner.num_live_runs.remote(), timeout=30)
            time.sleep(0.1)
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(old.actors[0].policy_version.remote(), timeout=30)
    pool.replace(0, "runner")
    new = routing(pool, 0)
    assert len(new.infos) == 2 and not {i.pid for i in new.infos} & {i.pid for i in old.infos}
    ray.get(pool.cells[0].runner.start_runs.remote([cfg.work.spec(960, runs_per_group=1)]))
    results, deadline = [], time.monotonic() + 60
    while not results and time.monotonic() < deadline:
        results = ray.get(pool.cells[0].runner.sample_results.remote())
        time.sleep(0.1)
    assert [r.run.run_id for r in results] == [cfg.work.spec(960, runs_per_group=1).run_id]


def run(cfg, pool, actuator_class=None):
    from ray_xlong.cells.actuator import RayActuator

    act = (actuator_class or RayActuator)(cfg, make_policy(cfg), pool)
    return act, act.run()


def final_weights(act) -> dict[str, torch.Tensor]:
    import ray

    return ray.get(act.learners.weights_ref)


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.serial
def test_broadcast_job_puts_the_learners_weights_into_every_engine(cells):
    """The same elastic job twice on the same cells: object store, then broadcast. Every
    engine of every cell the last step pushed to holds the Learner's weights bitwise (both
    engines of the cell), no push fell back, and both jobs train the same runs per step to
    the same weights (measured bitwise; to 1e-6, a step's updates are ~1e-3). Then the
    version-0 weights by the object store (``CellPool.push_weights``) reach all 4 engines
    bitwise."""
    import ray

    from benchmarks.tools.faults import audit

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
        assert engines_hold(pool, c, want), f"cell {c}"
    for r in (store, result):
        a = audit(r, JOB)
        assert (a.runs_lost, a.runs_trained_twice, a.steps) == (0, 0, JOB.total_steps)
        assert a.violations == ()
    assert [sorted(s) for s in store.trained_runs] == [sorted(s) for s in result.trained_runs]
    other, start = final_weights(store_act), ray.get(pool.initial_weights)
    assert max((want[k] - start[k]).abs().max().item() for k in want) > 1e-4   # it trained
    for k in want:     # measured bitwise equal; the tolerance allows another reduction order
        torch.testing.assert_close(want[k], other[k], rtol=0, atol=1e-6)
    assert pool.push_weights([0, 1], pool.initial_weights, 0) == []
    assert all(engines_hold(pool, c, start) for c in (0, 1))


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.serial
def test_a_runner_killed_at_a_sync_loses_nothing(cells):
    """A target's runner is killed just before the first broadcast: its engine actors die with
    it, the sender's group rendezvous times out (``weight_sync_timeout_s``), the job does not
    hang, the cell is rebuilt on the current weights with new engine actors, the next push makes
    a new group, and no run is lost or trained twice."""
    import ray

    from ray_xlong.cells.actuator import RayActuator
    from benchmarks.tools.faults import audit

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
    before = [routing(pool, c) for c in range(LAYOUT.cells)]
    act, result = run(dataclasses.replace(cfg, weight_sync="broadcast",
                                          weight_sync_timeout_s=5.0), pool, KillAtSync)
    assert KillAtSync.killed, "no push had a target"
    dead = KillAtSync.killed[0]
    for actor in before[dead].actors:                 # died with their runner
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(actor.policy_version.remote(), timeout=30)
    new = routing(pool, dead).infos
    assert len(new) == 2 and not {i.pid for i in new} & {i.pid for i in before[dead].infos}
    assert act.sync.failures >= 1 and pool.actors_replaced > replaced
    assert [f.kind for f in result.faults if f.cell == KillAtSync.killed[0]] == ["runner"]
    a = audit(result, JOB)
    assert (a.runs_lost, a.runs_trained_twice, a.steps) == (0, 0, JOB.total_steps)
    assert a.violations == ()
    want = final_weights(act)
    for c, role in enumerate(act.m.role):
        if role is not Role.TRAINING:
            assert engines_hold(pool, c, want), f"cell {c}"


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.serial
def test_a_sender_lost_at_a_sync_falls_back_to_the_object_store(cells):
    """The Learner that holds the step's weights is killed just before it broadcasts: every
    target's receive fails within ``weight_sync_timeout_s`` (its group aborted, its runner
    alive), the targets get the weights by the object store, the sender's cell is rebuilt,
    and no run is lost or trained twice."""
    import ray

    from ray_xlong.cells.actuator import RayActuator
    from benchmarks.tools.faults import audit

    class KillSenderAtSync(RayActuator):
        killed: list[int] = []

        def _push_weights(self):
            targets = [c for c, role in enumerate(self.m.role) if role is not Role.TRAINING]
            lead = self.learners.lead
            if targets and lead is not None and lead not in targets and not self.killed:
                self.killed.append(lead)
                ray.kill(self.cells[lead].learner, no_restart=True)
            return super()._push_weights()

    cfg, pool = cells
    act, result = run(dataclasses.replace(cfg, weight_sync="broadcast",
                                          weight_sync_timeout_s=5.0), pool, KillSenderAtSync)
    assert KillSenderAtSync.killed, "no push had a sender apart from its targets"
    assert act.sync.failures >= 1 and any(act.stats["broadcast_fallbacks"])
    assert [f.kind for f in result.faults if f.cell == KillSenderAtSync.killed[0]]
    a = audit(result, JOB)
    assert (a.runs_lost, a.runs_trained_twice, a.steps) == (0, 0, JOB.total_steps)
    want = final_weights(act)
    for c, role in enumerate(act.m.role):
        if role is not Role.TRAINING:
            assert engines_hold(pool, c, want), f"cell {c}"
