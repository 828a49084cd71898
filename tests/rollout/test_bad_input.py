"""Timeouts and bad input: each ends in a clear error, a recorded retry or a scored / failed run,
never a hang (budgets, tool limits, engine errors, malformed outputs, unknown tasks)."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from ray_xlong.rollout import Harness, HarnessConfig, ScriptedEngine
from ray_xlong.rollout.tasks import (ArithmeticTask, LongHorizonConfig, LongHorizonTask,
                                     Observation, TaskFailure, UnknownTaskError, make_task)


class BadTools:
    """A task whose tools crash, hang, flood or break the environment."""

    tools = ("crash", "hang", "flood", "break")

    def __init__(self):
        self.answer = None

    def reset(self):
        return Observation("Test tools.", "Call them.")

    async def call_tool(self, name, args):
        if name == "crash":
            raise ZeroDivisionError("tool bug")
        if name == "hang":
            await asyncio.sleep(3600)
        if name == "flood":
            return "x " * 5_000_000
        if name == "break":
            raise TaskFailure("sandbox died")
        raise KeyError(name)

    def submit(self, answer):
        self.answer = answer

    def score(self):
        return 0.5

    def close(self):
        pass


def scripted(chat, steps):
    """Emit ``steps`` in order (a tool name, or ``answer``), one per call."""
    it = iter(steps)
    return lambda ids: (lambda s: chat.answer_ids("done") if s == "answer"
                        else chat.call_ids(s))(next(it))


def run(chat, policy, env, **config):
    engine = ScriptedEngine(policy, vocab_size=512)
    cfg = HarnessConfig(**{"max_new_tokens": 16, "tool_timeout_s": 0.3, **config})
    return asyncio.run(Harness(engine, chat, config=cfg).run(env, run_id="r", group_id="g"))


def test_crashing_hanging_and_flooding_tools_become_error_results(chat):
    start = time.monotonic()
    result = run(chat, scripted(chat, ["crash", "hang", "flood", "nope", "answer"]), BadTools(),
                 max_tool_output_tokens=50)
    assert time.monotonic() - start < 10
    run_, info = result.run, result.info
    assert run_.status == "finished" and info.tool_errors == 3 and run_.reward == 0.5
    text = chat.decode(run_.calls[-1].input_ids)
    assert "ZeroDivisionError" in text and "timed out after 0.3 s" in text
    assert "[truncated]" in text and "unknown tool 'nope'" in text   # checked before the env
    assert run_.calls[-1].input_ids.size < 400          # the flood was cut to 50 tokens


def test_environment_failure_fails_the_run(chat):
    result = run(chat, scripted(chat, ["break"]), BadTools())
    assert result.run.status == "failed" and result.info.stop_reason == "task_failure"
    assert "sandbox died" in result.info.error and result.run.reward == 0.0


def test_malformed_outputs_are_retried_then_shown_to_the_agent(chat):
    outputs = iter([chat.encode("junk"), np.array([chat.call, chat.end]),
                    chat.encode("junk again") + 0, chat.answer_ids("5")])
    result = run(chat, lambda ids: next(outputs), ArithmeticTask(0), max_retries=1)
    run_, info = result.run, result.info
    assert info.retries == 2 and len(run_.calls) == 4
    assert np.array_equal(run_.calls[0].input_ids, run_.calls[1].input_ids)  # same context
    assert "error: malformed output" in chat.decode(run_.calls[3].input_ids)


def test_engine_errors_are_retried_then_fail_the_run(chat):
    failures = iter([True, False, True, True, True])

    def flaky(ids):
        if next(failures):
            raise RuntimeError("engine down")
        return chat.call_ids("add", "1 2")

    result = run(chat, flaky, ArithmeticTask(0), max_engine_retries=2)
    assert result.run.status == "failed" and result.info.engine_retries == 3
    assert "engine down" in result.info.error and len(result.run.calls) == 1


def test_token_budget_timeout_is_scored_on_partial_state(chat):
    task = ArithmeticTask(3)
    result = run(chat, lambda ids: chat.call_ids("add", f"{task.a} {task.b}"), task,
                 max_run_tokens=30)
    assert result.run.status == "timeout" and result.info.stop_reason == "token_budget"
    assert result.run.reward == 0.2                      # right tool call, no answer
    assert result.run.num_tokens <= 30


def test_wall_clock_timeout_is_scored_on_partial_state(chat):
    from ray_xlong.rollout.tasks.long_horizon import oracle_policy

    env = LongHorizonTask(0, config=LongHorizonConfig(num_steps=50, latency_sigma=0.0,
                                                      time_scale=0.1 / 60))
    start = time.monotonic()
    result = run(chat, oracle_policy(chat, num_steps=50, delegate_every=0), env,
                 wall_clock_s=0.5, max_calls=200, tool_timeout_s=5.0)
    assert time.monotonic() - start < 5
    assert result.run.status == "timeout" and result.info.stop_reason == "wall_clock"
    assert 0 < result.run.reward < 1 and result.run.reward == env.done / 50


def test_unknown_task_names_the_known_ones():
    with pytest.raises(UnknownTaskError, match="arithmetic"):
        make_task("no_such_task", seed=0)


@pytest.mark.parametrize("field,kwargs", [
    ("max_new_tokens", dict(max_new_tokens=0)), ("wall_clock_s", dict(wall_clock_s=0)),
    ("max_retries", dict(max_retries=-1)), ("temperature", dict(temperature=-0.5)),
    ("context_capacity", dict(context_capacity=100)),
])
def test_harness_config_errors_name_the_field(field, kwargs):
    with pytest.raises(ValueError, match=field):
        HarnessConfig(**kwargs)
