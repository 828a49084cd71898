"""Hard inputs and limits (issue 7, item 5): each ends as a recorded outcome, never a hang, a
crash of the whole batch or a silent drop.

Tools that hang (async, sync, deaf to cancellation), raise or flood; engines that raise or answer
with malformed results; tasks whose reset / submit / score break; runs over their token budget;
impossible harness / processor / scheduling configs. CPU-light: scripted policies and stub
engines, no model forward. Time limits here are generous hang guards, never assertions.
"""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest

from ray_xlong.rollout import Harness, HarnessConfig, ScriptedEngine
from ray_xlong.rollout.engine import EngineError, GenerateResult
from ray_xlong.rollout.tasks import ArithmeticTask, Observation
from ray_xlong.scheduling import SchedulingConfig
from ray_xlong.trajectory import ProcessorConfig, TrajectoryProcessor

pytestmark = pytest.mark.timeout(60)


class Env:
    """A task with configurable tools and task methods; ``tools`` maps a name to a callable
    ``(args) -> text`` (sync) or ``async (args) -> text``; ``sync_tools`` makes ``call_tool``
    itself a plain function."""

    def __init__(self, *, tools=None, reset=None, submit=None, score=None):
        self.handlers = tools or {}
        self.tools = tuple(self.handlers)
        self._reset, self._submit, self._score = reset, submit, score
        self.answer = None

    def reset(self):
        if self._reset:
            self._reset()
        return Observation("Test hard inputs.", "Use the tools.")

    async def call_tool(self, name, args):
        out = self.handlers[name](args)
        return await out if asyncio.iscoroutine(out) else out

    def submit(self, answer):
        if self._submit:
            self._submit(answer)
        self.answer = answer

    def score(self):
        return self._score() if self._score else 0.5

    def close(self):
        pass


class SyncEnv(Env):
    """The same, with a *synchronous* ``call_tool`` (blocking work allowed)."""

    def call_tool(self, name, args):
        return self.handlers[name](args)


def scripted(chat, steps):
    """Emit ``steps`` in order (a tool name, or ``answer``), one per call."""
    it = iter(steps)
    return lambda ids: (lambda s: chat.answer_ids("done") if s == "answer"
                        else chat.call_ids(s))(next(it))


def harness(chat, policy, **config):
    cfg = HarnessConfig(**{"max_new_tokens": 16, "tool_timeout_s": 0.3,
                           "score_timeout_s": 0.3, **config})
    return Harness(ScriptedEngine(policy, vocab_size=512), chat, config=cfg)


def run(chat, policy, env, **config):
    return asyncio.run(harness(chat, policy, **config).run(env, run_id="r", group_id="g"))


def tool_result_ids(run_):
    """The ids appended after the second-to-last call (its tool result), from the last input."""
    prev, last = run_.calls[-2], run_.calls[-1]
    return last.input_ids[prev.context_len:]


# ------------------------------------------------------------------------------ tools: hang

def test_tool_deaf_to_cancellation_is_cut_not_awaited(chat):
    """``asyncio.wait_for`` would wait for the cancelled tool to finish (an hour here)."""
    async def deaf(args):
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            await asyncio.sleep(3600)      # swallows the harness's cancel; asyncio.run's ends it

    result = run(chat, scripted(chat, ["deaf", "answer"]), Env(tools={"deaf": deaf}))
    assert result.run.status == "finished" and result.info.tool_errors == 1
    assert "tool deaf timed out after 0.3 s" in chat.decode(result.run.calls[-1].input_ids)


def test_blocking_sync_tool_is_cut_and_other_runs_go_on(chat):
    """A sync tool blocked forever (until the test releases it) costs its own thread only: the
    event loop serves the other run and the engine meanwhile, and the blocked run is answered."""
    release = threading.Event()
    blocked = SyncEnv(tools={"block": lambda args: release.wait() and "late"})
    quick = SyncEnv(tools={"echo": lambda args: f"echo {args.get('args', '')}!"})
    # One harness, two concurrent runs; each env's policy is told apart by its prompt.
    blocked.reset = lambda: Observation("Test hard inputs.", "blocking task")
    quick.reset = lambda: Observation("Test hard inputs.", "quick task")
    order = {"blocking": iter(["block", "answer"]), "quick": iter(["echo", "answer"])}

    def by_prompt(ids):
        step = next(order["blocking" if "blocking" in chat.decode(ids) else "quick"])
        return chat.answer_ids("done") if step == "answer" else chat.call_ids(step)

    h = harness(chat, by_prompt)
    try:
        results = asyncio.run(h.run_many([blocked, quick], run_ids=["b", "q"],
                                         group_ids=["g", "g"]))
    finally:
        release.set()
    b, q = results
    assert b.run.status == "finished" and b.info.tool_errors == 1
    assert "tool block timed out" in chat.decode(b.run.calls[-1].input_ids)
    assert q.run.status == "finished" and q.info.tool_errors == 0
    assert "echo !" in chat.decode(q.run.calls[-1].input_ids)


def test_sync_tool_results_and_errors_reach_the_agent(chat):
    def broken(args):
        raise OSError("disk gone")

    env = SyncEnv(tools={"ok": lambda args: "fine", "broken": broken})
    result = run(chat, scripted(chat, ["ok", "broken", "answer"]), env)
    text = chat.decode(result.run.calls[-1].input_ids)
    assert result.run.status == "finished" and result.info.tool_errors == 1
    assert "fine" in text and "crashed: OSError('disk gone')" in text


# ------------------------------------------------------------------------------ tools: flood

FLOODS = [
    pytest.param(lambda: "x " * 2_500_000, id="many-words"),
    pytest.param(lambda: "x" * 5_000_000, id="one-long-word"),
    pytest.param(lambda: "\ud800" * 1_000_000, id="lone-surrogates"),
    pytest.param(lambda: b"\x00" * 3_000_000, id="bytes"),
    pytest.param(lambda: ["row"] * 500_000, id="not-a-string"),
]


@pytest.mark.parametrize("make", FLOODS)
def test_flooding_tool_is_cut_marked_and_counted(chat, make):
    max_tokens = 40
    env = Env(tools={"flood": lambda args: make()})
    result = run(chat, scripted(chat, ["flood", "answer"]), env, max_tool_output_tokens=max_tokens)
    assert result.run.status == "finished" and result.info.tool_truncations == 1
    ids = tool_result_ids(result.run)
    marker = chat.encode(" [truncated]")
    # [tool] <= max_tokens ids, the marker, [end] [assistant]
    assert ids.size <= 1 + max_tokens + marker.size + 2
    assert np.array_equal(ids[-2 - marker.size:-2], marker)


def test_short_tool_output_is_not_marked(chat):
    result = run(chat, scripted(chat, ["small", "answer"]), Env(tools={"small": lambda a: "7"}),
                 max_tool_output_tokens=40)
    assert result.info.tool_truncations == 0
    assert "[truncated]" not in chat.decode(tool_result_ids(result.run))


# ------------------------------------------------------------------------------ engines

class StubEngine:
    """An engine answering with ``answer(attempt) -> GenerateResult`` (or raising)."""

    policy_version = 0

    def __init__(self, answer):
        self.answer, self.attempts = answer, 0

    async def generate(self, input_ids, *, sampling):
        self.attempts += 1
        return self.answer(self.attempts)


def ok_result(chat):
    out = chat.answer_ids("done")
    return GenerateResult(out, np.full(out.size, -0.5), 0, "stop")


def broken(kind, chat):
    out = chat.answer_ids("done")

    def answer(attempt):
        if kind == "raises":
            raise ConnectionError("actor died")
        if kind == "engine-error":
            raise EngineError("batch failed")
        if kind == "short-logprobs":
            return GenerateResult(out, np.full(out.size - 1, -0.5), 0, "stop")
        if kind == "nan-logprobs":
            return GenerateResult(out, np.full(out.size, np.nan), 0, "stop")
        if kind == "negative-id":
            return GenerateResult(np.array([-3, chat.end]), np.full(2, -0.5), 0, "stop")
        if kind == "float-ids":
            return GenerateResult(out.astype(float), np.full(out.size, -0.5), 0, "stop")
        if kind == "bad-version":
            return GenerateResult(out, np.full(out.size, -0.5), -1, "stop")
        if kind == "not-a-result":
            return None
        raise AssertionError(kind)
    return answer


@pytest.mark.parametrize("kind,error", [
    pytest.param("raises", "ConnectionError", id="raises"),
    pytest.param("engine-error", "batch failed", id="engine-error"),
    pytest.param("short-logprobs", "output_logprobs has", id="short-logprobs"),
    pytest.param("nan-logprobs", "NaN", id="nan-logprobs"),
    pytest.param("negative-id", "negative id", id="negative-id"),
    pytest.param("float-ids", "must hold integers", id="float-ids"),
    pytest.param("bad-version", "policy_version", id="bad-version"),
    pytest.param("not-a-result", "output_ids", id="not-a-result"),
])
def test_engine_trouble_is_retried_then_fails_the_run_with_the_error(chat, kind, error):
    engine = StubEngine(broken(kind, chat))
    h = Harness(engine, chat, config=HarnessConfig(max_new_tokens=16, max_engine_retries=2))
    result = asyncio.run(h.run(ArithmeticTask(0), run_id="r", group_id="g"))
    assert result.run.status == "failed" and result.info.stop_reason == "engine_error"
    assert error in result.info.error
    assert engine.attempts == 3 and result.info.engine_retries == 2
    assert result.run.calls == ()                         # nothing malformed was recorded


def test_engine_recovering_within_its_retries_finishes_the_run(chat):
    def answer(attempt):
        if attempt == 1:
            raise ConnectionError("blip")
        return ok_result(chat)

    h = Harness(StubEngine(answer), chat, config=HarnessConfig(max_new_tokens=16))
    result = asyncio.run(h.run(ArithmeticTask(0), run_id="r", group_id="g"))
    assert result.run.status == "finished" and result.info.engine_retries == 1


def test_engine_answering_past_max_tokens_is_an_engine_error(chat):
    def answer(attempt):
        out = np.concatenate([[chat.answer], np.full(40, 300), [chat.end]])
        return GenerateResult(out, np.full(out.size, -0.5), 0, "length")

    h = Harness(StubEngine(answer), chat, config=HarnessConfig(max_new_tokens=16))
    result = asyncio.run(h.run(ArithmeticTask(0), run_id="r", group_id="g"))
    assert result.run.status == "failed" and "max_tokens 16" in result.info.error


# ------------------------------------------------------------------------------ task methods

def _raise(exc):
    def f(*args):
        raise exc
    return f


@pytest.mark.parametrize("env_kwargs,reason,error", [
    pytest.param(dict(reset=_raise(KeyError("no fixture"))), "task_failure",
                 "env.reset raised KeyError", id="reset-raises"),
    pytest.param(dict(submit=_raise(RuntimeError("disk full"))), "task_failure",
                 "env.submit raised RuntimeError", id="submit-raises"),
    pytest.param(dict(score=_raise(ZeroDivisionError("grader bug"))), "score_error",
                 "env.score raised ZeroDivisionError", id="score-raises"),
    pytest.param(dict(score=lambda: float("nan")), "score_error", "finite", id="score-nan"),
    pytest.param(dict(score=lambda: "high"), "score_error", "ValueError", id="score-not-a-number"),
])
def test_broken_task_methods_fail_the_run_with_the_error(chat, env_kwargs, reason, error):
    result = run(chat, scripted(chat, ["answer"]), Env(**env_kwargs))
    assert result.run.status == "failed" and result.info.stop_reason == reason
    assert error in result.info.error and result.run.reward == 0.0


def test_hanging_score_fails_the_run_after_its_limit(chat):
    release = threading.Event()
    try:
        result = run(chat, scripted(chat, ["answer"]), Env(score=lambda: release.wait() or 1.0))
    finally:
        release.set()
    assert result.run.status == "failed" and result.info.stop_reason == "score_error"
    assert "env.score took over 0.3 s" in result.info.error


def test_one_broken_env_loses_no_other_run_of_the_batch(chat):
    """``run_many`` gathers runs: one raising would have lost all the others' results."""
    envs = [Env(), Env(reset=_raise(ValueError("bad seed"))), Env()]
    h = harness(chat, lambda ids: chat.answer_ids("done"))
    results = asyncio.run(h.run_many(envs, run_ids=["a", "b", "c"], group_ids=["g"] * 3))
    assert [r.run.status for r in results] == ["finished", "failed", "finished"]
    assert "bad seed" in results[1].info.error


# ------------------------------------------------------------------------------ token budget

def test_run_over_its_token_budget_is_a_scored_timeout_and_is_trained(chat):
    task = ArithmeticTask(3)
    result = run(chat, lambda ids: chat.call_ids("add", f"{task.a} {task.b}"), task,
                 max_run_tokens=30)
    assert result.run.status == "timeout" and result.info.stop_reason == "token_budget"
    assert result.run.num_tokens <= 30 and result.run.reward == 0.2  # partial credit
    batch = TrajectoryProcessor(ProcessorConfig(pack="none")).process([result.run])
    assert batch.stats.runs == 1 and batch.stats.runs_timeout == 1
    assert batch.stats.trainable_tokens == result.run.num_tokens


# ------------------------------------------------------------------------------ configs

@pytest.mark.parametrize("field,kwargs", [
    pytest.param("tool_timeout_s", dict(tool_timeout_s=float("inf")), id="tool-timeout-inf"),
    pytest.param("tool_timeout_s", dict(tool_timeout_s=0), id="tool-timeout-0"),
    pytest.param("wall_clock_s", dict(wall_clock_s=float("nan")), id="wall-clock-nan"),
    pytest.param("wall_clock_s", dict(wall_clock_s=float("inf")), id="wall-clock-inf"),
    pytest.param("score_timeout_s", dict(score_timeout_s=-1.0), id="score-timeout-negative"),
    pytest.param("score_timeout_s", dict(score_timeout_s="10"), id="score-timeout-str"),
    pytest.param("max_tool_output_tokens", dict(max_tool_output_tokens=0), id="no-tool-output"),
    pytest.param("max_run_tokens", dict(max_run_tokens=0), id="no-token-budget"),
    pytest.param("max_engine_retries", dict(max_engine_retries=-1), id="negative-retries"),
    pytest.param("compaction_budget", dict(compaction_budget=4096), id="compaction-too-big"),
])
def test_impossible_harness_configs_name_the_field(field, kwargs):
    with pytest.raises(ValueError, match=field):
        HarnessConfig(**kwargs)


@pytest.mark.parametrize("field,kwargs", [
    pytest.param("max_trajectories_per_run", dict(max_trajectories_per_run=0), id="k-0"),
    pytest.param("row_tokens", dict(row_tokens=0), id="row-smaller-than-a-token"),
    pytest.param("vocab_size", dict(vocab_size=0), id="vocab-0"),
    pytest.param("pad_token_id", dict(vocab_size=8, pad_token_id=8), id="pad-outside-vocab"),
    pytest.param("on_malformed_run", dict(on_malformed_run="ignore"), id="unknown-policy"),
])
def test_impossible_processor_configs_name_the_field(field, kwargs):
    with pytest.raises(ValueError, match=field):
        ProcessorConfig(**kwargs)


@pytest.mark.parametrize("field,args", [
    pytest.param("staleness_bound", (10, 2, 4, -1), id="negative-staleness"),
    pytest.param("batch_groups", (10, 0, 4, 1), id="no-groups"),
    pytest.param("runs_per_group", (10, 2, 0, 1), id="empty-groups"),
    pytest.param("total_steps", (0, 2, 4, 1), id="no-steps"),
])
def test_impossible_scheduling_configs_name_the_field(field, args):
    with pytest.raises(ValueError, match=field):
        SchedulingConfig(*args)
