"""Tasks: the interface contract for every registered task, and the code task's real tools."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from ray_xlong.rollout.tasks import TASKS, CodeTask, ToolError, make_task
from ray_xlong.rollout.tasks.arithmetic import ArithmeticTask, demonstration
from ray_xlong.rollout.tasks.code import demonstration_calls, passed_fraction


@pytest.mark.parametrize("name", sorted(TASKS))
def test_task_contract(name):
    env = make_task(name, seed=1)
    try:
        obs = env.reset()
        assert obs.system and obs.prompt and env.tools
        with pytest.raises(ToolError):
            asyncio.run(env.call_tool("no_such_tool", {}))
        assert 0.0 <= env.score() <= 1.0
        env.submit("whatever")
        assert 0.0 <= env.score() <= 1.0
        assert make_task(name, seed=1).reset() == obs        # deterministic per seed
    finally:
        env.close()


def test_arithmetic_rewards_answer_and_partial_credit():
    task = ArithmeticTask(4)
    task.reset()
    assert task.score() == 0.0
    assert asyncio.run(task.call_tool("add", {"a": task.a, "b": task.b})) == str(task.a + task.b)
    assert task.score() == 0.2
    task.submit(str(task.a + task.b))
    assert task.score() == 1.0


def test_arithmetic_demonstration_masks_the_model_turns(chat):
    ids, mask = demonstration(ArithmeticTask(0), chat)
    assert ids.size == mask.size and 0 < mask.sum() < ids.size
    assert chat.decode(ids[mask]).startswith("<|call|>add")
    assert all(t["type"] == "function" for t in ArithmeticTask(0).tools)   # OpenAI schemas


def run_code(task, calls):
    return [asyncio.run(task.call_tool(name, args)) for name, args in calls]


def test_code_task_full_partial_and_hanging_solutions():
    task = CodeTask(0, test_timeout_s=60.0)     # generous: a loaded CI machine starts pytest slowly
    try:
        task.reset()
        assert task.score() == 0.0
        outputs = run_code(task, demonstration_calls(task))
        assert "passed" in outputs[-1] and task.score() == 1.0
        first = task.funcs[0]
        second = demonstration_calls(task)[0][1]["content"].split("return ")[2]
        run_code(task, [("write", {"path": "solution.py", "content":
                                   f"def {first}(a, b):\n    return 0\n"
                                   f"def {task.funcs[1]}(a, b):\n    return {second}"})])
        assert 0.0 < task.score() < 1.0
        task.test_timeout_s = 1.0
        run_code(task, [("write", {"path": "solution.py", "content": "while True:\n    pass\n"})])
        assert "killed after 1 s" in run_code(task, [("run_tests", {})])[0]
        assert task.score() == 0.0
        with pytest.raises(ToolError, match="outside"):
            run_code(task, [("write", {"path": "../escape.py", "content": "x = 1"})])
    finally:
        task.close()
    assert not task.workspace.exists()


@pytest.mark.parametrize("text,expected", [
    pytest.param("3 passed in 0.1s", 0.75, id="all-run-passed"),
    pytest.param("1 failed, 2 passed in 0.1s", 0.5, id="mixed"),
    pytest.param("no tests ran", 0.0, id="none"),
])
def test_passed_fraction(text, expected):
    assert passed_fraction(text, 4) == expected


def test_long_horizon_latencies_are_heavy_tailed_and_seeded():
    from ray_xlong.rollout.tasks import LongHorizonConfig, LongHorizonTask

    def latencies(seed):
        env = LongHorizonTask(seed, config=LongHorizonConfig(num_steps=400, time_scale=1e-9))
        env.reset()
        out = []
        for k in range(1, 401):
            before = env.tool_seconds
            asyncio.run(env.call_tool("work", {"step": k}))
            out.append(env.tool_seconds - before)
        return np.array(out)

    a = latencies(0)
    np.testing.assert_array_equal(a, latencies(0))
    assert a.max() > 10 * np.median(a)                    # heavy tail (sigma 1.5)


def test_long_horizon_run_pace_makes_a_runs_tool_time_lognormal():
    # latency_sigma 0, run_sigma 0.8: every step of a run takes median × pace, one pace per run,
    # so a run's tool time is 4 × 100 s × exp(0.8 z): log-std 0.8 over runs, median 400 s
    from ray_xlong.rollout.tasks import LongHorizonConfig, LongHorizonTask

    cfg = LongHorizonConfig(num_steps=4, latency_median_s=100.0, latency_sigma=0.0,
                            run_sigma=0.8, time_scale=1e-12)

    def total(seed):
        env = LongHorizonTask(seed, config=cfg)
        env.reset()
        for k in range(1, 5):
            asyncio.run(env.call_tool("work", {"step": k}))
        return env.tool_seconds

    totals = np.array([total(s) for s in range(400)])
    assert np.std(np.log(totals)) == pytest.approx(0.8, abs=0.08)
    assert np.median(totals) == pytest.approx(400.0, rel=0.15)
    assert total(7) == total(7)
