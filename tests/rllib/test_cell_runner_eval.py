"""``CellRunner``'s evaluation runs (``rllib/cell_actors.py``), built directly (the logic is the
same inside an actor): they end in ``take_eval``, never in ``wait_ended`` nor the spool; a switch
to training cancels the live ones (reported preempted) instead of waiting for them; a runner that
takes no runs reports new ones preempted at once."""

from __future__ import annotations

import asyncio
import time

import pytest
from algo_helpers import scripted_factory
from ray.rllib.algorithms.ppo import PPOConfig

from ray_xlong.models import build_tiny_model_dir
from ray_xlong.rllib.cell_actors import CellRunner
from ray_xlong.rllib.env_runner import RolloutConfig, RunSpec
from ray_xlong.rollout import HarnessConfig
from ray_xlong.rollout.tasks.arithmetic import ArithmeticTask

pytestmark = pytest.mark.rllib


class SlowAdd(ArithmeticTask):
    """Arithmetic whose tool never answers: a run stays live with the engine idle."""

    async def call_tool(self, name, args):
        await asyncio.sleep(3600)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(build_tiny_model_dir(tmp_path_factory.mktemp("evalrunner") / "m", seed=0))


def make_runner(model_dir, spool_dir):
    cfg = RolloutConfig(model_dir=model_dir, harness=HarnessConfig(max_new_tokens=16),
                        engine_factory=scripted_factory(model_dir))
    return CellRunner(config=PPOConfig(), rollout_config=cfg, tasks={"xl_slow_add": SlowAdd},
                      cell=3, spool_dir=str(spool_dir))


def take_eval_until(runner, n, timeout_s=30.0):
    ended, preempted, deadline = [], [], time.monotonic() + timeout_s
    while len(ended) + len(preempted) < n and time.monotonic() < deadline:
        report = runner.take_eval()
        ended += report.ended
        preempted += report.preempted
        time.sleep(0.02)
    return ended, preempted


def test_evaluation_runs_end_apart_and_a_switch_preempts_the_live_ones(model_dir, tmp_path):
    runner = make_runner(model_dir, tmp_path / "spool")
    try:
        runner.start_runs([RunSpec("arithmetic", 7, "r0", "g0")])
        assert runner.start_eval_runs([RunSpec("arithmetic", 7, "e0-0-0", "eval0-0"),
                                       RunSpec("xl_slow_add", 7, "e0-1-0", "eval0-1")]) == 2
        ended, _ = take_eval_until(runner, 1)
        assert [(o.run_id, o.group_id, o.reward, o.cell) for o in ended] == [
            ("e0-0-0", "eval0-0", 1.0, 3)]
        digests = []
        deadline = time.monotonic() + 30
        while not digests and time.monotonic() < deadline:
            digests += runner.wait_ended(0.2)[0]
        assert [d.run_id for d in digests] == ["r0"]           # training's run only
        assert runner.spool.run_ids() == {"r0"}                 # evaluation is never spooled
        assert runner.num_live_runs() == 1                      # e0-1-0 waits on its tool
        runner.suspend()                                        # to training: no waiting
        assert runner.num_live_runs() == 0
        assert runner.take_eval().preempted == ("e0-1-0",)
        assert runner.start_eval_runs([RunSpec("arithmetic", 7, "e1-0-0", "eval1-0")]) == 0
        assert runner.take_eval().preempted == ("e1-0-0",)      # asleep: refused at once
    finally:
        runner.stop()
