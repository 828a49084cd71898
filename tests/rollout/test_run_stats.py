"""Agent statistics: the harness's counting points on a scripted run with known branching, and
the per-step summary (sums, means, stop reasons, wall-time percentiles)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from ray_xlong.models import load_model
from ray_xlong.rollout import Harness, HarnessConfig, ScriptedEngine
from ray_xlong.rollout.run_stats import (STOP_KEYS, RunStats, agent_step_stats, run_stats)
from ray_xlong.rollout.tasks import ArithmeticTask
from tests.rollout.test_harness import CONFIG, branching_policy


def stats(stop="finished", wall_s=1.0, **counts) -> RunStats:
    base = dict(turns=0, model_calls=0, tool_calls=0, tool_errors=0, malformed=0, retries=0,
                compactions=0, subagents=0, template_rewrites=0, tokens=0)
    return RunStats(stop=stop, wall_s=wall_s, **{**base, **counts})


def test_scripted_run_counts_every_kind_of_event(model_dir, chat):
    # main: "oops" (malformed, retried) → add → subagent [sub1: add → answer] → compaction
    #       (summary call) → answer.  Turns: add, subagent, answer = 3 (the retried output is
    # not acted on); tool calls: add, subagent, sub1's add = 3; model calls = 7.
    task = ArithmeticTask(5)
    engine = ScriptedEngine(branching_policy(chat, task), vocab_size=512,
                            model=load_model(model_dir))
    result = asyncio.run(Harness(engine, chat, config=CONFIG).run(task, run_id="r",
                                                                   group_id="g"))
    s = run_stats(result)
    assert s.stop == "finished"
    assert (s.turns, s.model_calls, s.tool_calls, s.tool_errors) == (3, 7, 3, 0)
    assert (s.malformed, s.retries, s.compactions, s.subagents) == (1, 1, 1, 1)
    assert s.tokens == result.run.num_tokens and s.wall_s > 0


def test_a_call_budget_timeout_and_tool_errors_are_counted(model_dir, chat):
    # Every output calls a tool that does not exist: each is a tool error; the main agent
    # runs out of calls (max_calls=3) → timeout / call_budget.
    task = ArithmeticTask(1)
    engine = ScriptedEngine(lambda ids: chat.call_ids("nope", "x"), vocab_size=512,
                            model=load_model(model_dir))
    config = HarnessConfig(max_new_tokens=48, max_calls=3)
    s = run_stats(asyncio.run(Harness(engine, chat, config=config).run(task, run_id="r",
                                                                         group_id="g")))
    assert s.stop == "timeout_call_budget"
    assert (s.turns, s.model_calls, s.tool_calls, s.tool_errors, s.malformed) == (3, 3, 3, 3, 0)


def test_step_summary_sums_means_stops_and_percentiles():
    runs = [stats(turns=2, tokens=10, wall_s=1.0), stats(turns=4, tokens=30, wall_s=3.0),
            stats("timeout_wall_clock", turns=6, tool_errors=1, template_rewrites=2, wall_s=2.0),
            stats("failed_engine_error", wall_s=10.0)]
    m = agent_step_stats(runs).as_metrics()
    assert m["runs"] == 4 and m["turns_sum"] == 12 and m["turns_mean"] == 3.0
    assert m["tokens_sum"] == 40 and m["tokens_per_run"] == 10.0
    assert m["tool_errors_sum"] == 1 and m["template_rewrites_sum"] == 2
    assert (m["stop_finished"], m["stop_timeout_wall_clock"],
            m["stop_failed_engine_error"]) == (2, 1, 1)
    assert sum(m[f"stop_{k}"] for k in STOP_KEYS) == 4
    assert m["wall_s_p50"] == pytest.approx(np.percentile([1, 3, 2, 10], 50))   # 2.5
    assert m["wall_s_p95"] == pytest.approx(np.percentile([1, 3, 2, 10], 95))   # 8.95
    assert all(np.isfinite(v) for v in m.values())


def test_an_empty_step_has_every_key_and_zeros():
    m = agent_step_stats([]).as_metrics()
    assert set(f"stop_{k}" for k in STOP_KEYS) <= set(m)
    assert all(v == 0 for v in m.values())
