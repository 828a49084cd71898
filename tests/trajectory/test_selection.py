"""Selection: at most K per run, main > its summaries > subagents, deterministic within a rank."""

from __future__ import annotations

import pytest

from ray_xlong.trajectory import ProcessorConfig, TrajectoryProcessor, assemble, select
from tests.trajectory.words import (DONE, EDIT, FOUND, LOOK, PLAN, SUBTASK, SUM1, SUMMARIZE, SYS,
                                    TASK, TOOL, mk, mkrun)


def branching_run():
    """main (2 calls), a retry of main's first call, a summary of main, two subagents, and a
    summary of subagent sub1 — 6 trajectories."""
    return mkrun([
        mk("main", "main", [SYS, TASK], [PLAN, EDIT]),                       # t0 main
        mk("main", "main", [SYS, TASK, PLAN, EDIT, TOOL], [DONE]),
        mk("main", "main", [SYS, TASK], [LOOK]),                             # t1 retry of main
        mk("main", "summary", [SYS, TASK, PLAN, EDIT, SUMMARIZE], [SUM1]),   # t2 summary
        mk("sub1", "subagent", [SYS, SUBTASK], [LOOK, FOUND], parent="main"),  # t3 subagent
        mk("sub2", "subagent", [SYS, SUBTASK, TOOL], [FOUND], parent="main"),  # t4 subagent
        mk("sub1", "summary", [SYS, SUBTASK, SUMMARIZE], [SUM1]),               # t5
    ])


def test_ranking_is_main_then_summaries_then_subagents():
    kept, dropped = select(assemble(branching_run()), 6)
    order = [(t.agent_id, t.kind, t.num_generated) for t in kept]
    assert order == [("main", "main", 3), ("main", "main", 1), ("main", "summary", 1),
                     ("sub1", "subagent", 2),
                     # rank 2 ties on generated tokens (1) break by creation order
                     ("sub2", "subagent", 1), ("sub1", "summary", 1)]
    assert dropped == []


@pytest.mark.parametrize("k, kept_kinds", [
    pytest.param(1, ["main"], id="k1-keeps-longest-main"),
    pytest.param(3, ["main", "main", "summary"], id="k3-summary-before-subagents"),
    pytest.param(5, ["main", "main", "summary", "subagent", "subagent"], id="k5-default"),
])
def test_cap_keeps_the_top_k(k, kept_kinds):
    kept, dropped = select(assemble(branching_run()), k)
    assert [t.kind for t in kept] == kept_kinds
    assert len(dropped) == 6 - k


def test_selection_is_deterministic_whatever_the_input_order():
    trajs = assemble(branching_run())
    a, _ = select(trajs, 4)
    b, _ = select(list(reversed(trajs)), 4)
    assert [t.index for t in a] == [t.index for t in b]


def test_dropped_count_is_reported():
    batch = TrajectoryProcessor(ProcessorConfig(max_trajectories_per_run=5, pack="none")).process(
        [branching_run()])
    assert batch.stats.trajectories_kept == 5 and batch.stats.trajectories_dropped == 1
    assert batch.dropped[0].agent_id == "sub1" and batch.dropped[0].kind == "summary"


def test_cap_must_be_positive():
    with pytest.raises(ValueError, match="max_trajectories_per_run"):
        ProcessorConfig(max_trajectories_per_run=0)
