"""One run of paper length end to end on a cell: the ``long_horizon`` task of 200 steps (≥ 300
model calls, context compaction, a subagent every third step) solved by its scripted oracle
through the cell's harness → the run spool → per-run processing on the runner → one training
step on a 2-rank cell whose ranks split the run's tree row by token ranges
(``LearnerSettings.context_parallel=2``) → the new weights back in the cell's engine.

The oracle's engine scores its tokens with the same tiny model on one device, so the behaviour
logprobs of the trained runs are a single-device computation of the Learner's version-0 logprobs:
the step's ``max |log r|`` (``LearnerStepStats``, the ranks' parts merged) is the largest
difference between the context-parallel logprobs and the single-device ones."""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import sys
import tempfile

import pytest
import torch

from ray_xlong.cells.config import CellJobConfig, LearnerSettings
from ray_xlong.cells.layout import CellLayout
from ray_xlong.cells.long_horizon_job import TASK_NAME, LongHorizonJob
from ray_xlong.cells.sharded_cell import ShardedCell
from ray_xlong.cells.sharding import ShardingSettings
from ray_xlong.cells.spool import RunSpool
from ray_xlong.cells.actuator import RayActuator
from ray_xlong.cells.config import make_policy
from ray_xlong.jobs.driver import start_cells
from ray_xlong.models import TinyModelConfig, build_tiny_model_dir, load_model
from ray_xlong.rollout import HarnessConfig
from ray_xlong.rollout.tasks.long_horizon import LongHorizonConfig, LongHorizonTask
from ray_xlong.scheduling import SchedulingConfig

pytestmark = [pytest.mark.ray, pytest.mark.slow]

STEPS = 200
EXTRA = 20
"""Odd-seeded runs have this many more steps than the oracle does: they end with a partial
score (200 / 220), so the group's advantages are not zero and the step moves the weights."""


def mixed_length_task(config: LongHorizonConfig, seed: int) -> LongHorizonTask:
    return LongHorizonTask(seed, config=dataclasses.replace(
        config, num_steps=config.num_steps + EXTRA * (seed % 2)))


class SpoolReader:
    """A step observer that reads each run back from the spool when its digest arrives (once
    trained, the spool drops it: the job has no checkpoint to wait for)."""

    def __init__(self, root: str) -> None:
        self.spool, self.runs = RunSpool(root), {}

    def delivered(self, digest) -> None:
        (_, result), = self.spool.get([digest.run_id]).values()
        self.runs[digest.run_id] = result.run

    def taken(self, step, micro, stats) -> None:
        pass

    def staleness(self, step, stale) -> None:
        pass


@dataclasses.dataclass(frozen=True, slots=True)
class MixedLengthJob(LongHorizonJob):
    """The long-horizon job whose odd-seeded runs stop short of the task's end."""

    def tasks(self) -> dict:
        return {TASK_NAME: functools.partial(mixed_length_task, self.task)}


def test_a_300_call_run_trains_on_two_context_parallel_ranks_and_reaches_the_engine(tmp_path):
    import ray

    os.environ["RAY_TMPDIR"] = tempfile.mkdtemp(prefix="rx", dir="/tmp")
    ray.init(num_cpus=2, num_gpus=1, include_dashboard=False, log_to_driver=False,
             object_store_memory=200 * 1024 ** 2)
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])   # runners need no tests/
    try:
        model_dir = str(build_tiny_model_dir(
            tmp_path / "m", seed=0,
            config=TinyModelConfig(hidden_size=64, num_layers=1, num_heads=1, num_kv_heads=1,
                                   intermediate_size=128, max_position_embeddings=1 << 16)))
        spool = tmp_path / "spool"
        config = CellJobConfig(
            mode="colocated",
            job=SchedulingConfig(total_steps=2, batch_groups=1, runs_per_group=2,
                                 staleness_bound=0),
            layout=CellLayout(cells=1, nodes_per_cell=1, gpus_per_node=1, cpus_per_bundle=1.0,
                              strategy="PACK"),
            learner=LearnerSettings(model_dir=model_dir, lr=1e-3, context_parallel=2),
            sharding=ShardingSettings(ranks_per_cell=2), slots_per_cell=2,
            work=MixedLengthJob(task=LongHorizonConfig(num_steps=STEPS, latency_median_s=1.0,
                                                       latency_sigma=0.5, time_scale=1e-6)),
            harness=HarnessConfig(max_new_tokens=32, context_capacity=4096,
                                  compaction_budget=2048, max_run_tokens=1 << 30,
                                  wall_clock_s=1e6, max_calls=4 * STEPS + 8),
            spool_dir=str(spool))
        pool = start_cells(config)
        try:
            cell = pool.cells[0]
            assert isinstance(cell.learner, ShardedCell) and len(cell.learner) == 2
            reader = SpoolReader(str(spool))
            result = RayActuator(config, make_policy(config), pool, observer=reader).run()
            assert [e.kind for e in result.events].count("step_ended") == 2
            step1, step2 = result.trained_runs

            # the spool held both runs as they ended: paper-length, compacted, branched
            runs = reader.runs
            assert len(runs) == 4 and set(runs) == {*step1, *step2}, sorted(runs)
            for run in runs.values():
                assert len(run.calls) >= 300 and run.num_tokens > 0
                kinds = {c.kind for c in run.calls}
                assert kinds == {"main", "summary", "subagent"}, kinds   # compacted, branched
            for ids in (step1, step2):
                assert sorted(round(runs[r].reward, 4) for r in ids) == \
                    [round(STEPS / (STEPS + EXTRA), 4), 1.0]

            # the step on 2 context-parallel ranks: its logprobs are the single-device ones
            stats = ray.get(cell.learner.take_step_stats.remote(0))
            assert stats is not None and stats.loss.tokens > 0
            assert stats.loss.log_ratio_max <= 1e-4, stats.loss
            # both runs train the oracle's 200 steps (the odd one scores 200/220): as many
            # targets with opposite advantages, so at ratio ~1 the loss's value is ~0 (exactly
            # 0.0 in some runs); its gradient is not: the step moves the weights
            assert math.isfinite(stats.loss.loss_sum) and stats.grad_norm > 0 \
                and stats.total > 0

            # step 2's runs ran on version 1, whose logprobs (the engine's, on one device)
            # equal the Learner's 2-rank ones: the new weights reached the engine
            assert {c.policy_version for rid in step2 for c in runs[rid].calls} == {1}
            stats = ray.get(cell.learner.take_step_stats.remote(1))
            assert stats is not None and stats.loss.tokens > 0
            assert stats.loss.log_ratio_max <= 1e-4, stats.loss
            learner_w = ray.get(cell.learner.get_weights.remote())
            start = load_model(model_dir).state_dict()
            assert any(not torch.equal(start[n], t) for n, t in learner_w.items())
        finally:
            pool.shutdown()
    finally:
        ray.shutdown()
