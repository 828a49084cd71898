"""Assembly: calls → trajectories (joins, summaries, compaction, subagents, retries)."""

from __future__ import annotations

import numpy as np

from ray_xlong.trajectory import ModelCall, assemble
from ray_xlong.trajectory.assembly import join_tokens
from tests.trajectory.words import (BAD, DONE, EDIT, FIX, FOUND, LOOK, PLAN, RESULT, SUBTASK,
                                    SUM1, SUM2, SUMMARIZE, SYS, TASK, TEST, TOOL, TOOL2, mk, mkrun)


def test_calls_that_extend_the_context_form_one_trajectory():
    run = mkrun([mk("main", "main", [SYS, TASK], [PLAN]),
                 mk("main", "main", [SYS, TASK, PLAN, TOOL], [EDIT, TEST]),
                 mk("main", "main", [SYS, TASK, PLAN, TOOL, EDIT, TEST, TOOL2], [DONE])])
    (t,) = assemble(run)
    assert t.token_ids.tolist() == [SYS, TASK, PLAN, TOOL, EDIT, TEST, TOOL2, DONE]
    # generated: PLAN (pos 2), EDIT TEST (4-5), DONE (7); TOOL/TOOL2 are context
    assert t.generated_mask().tolist() == [0, 0, 1, 0, 1, 1, 0, 1]
    assert t.call_indices == (0, 1, 2) and t.origin == "start" and t.kind == "main"


def test_summary_call_is_its_own_trajectory_even_when_it_extends_main():
    run = mkrun([mk("main", "main", [SYS, TASK], [PLAN]),
                 mk("main", "summary", [SYS, TASK, PLAN, SUMMARIZE], [SUM1, SUM2])])
    main, summary = assemble(run)
    assert main.kind == "main" and summary.kind == "summary"
    assert summary.token_ids.tolist() == [SYS, TASK, PLAN, SUMMARIZE, SUM1, SUM2]
    assert summary.rank == 1 and main.rank == 0


def test_compaction_starts_a_new_trajectory():
    run = mkrun([mk("main", "main", [SYS, TASK], [PLAN]),
                 mk("main", "summary", [SYS, TASK, PLAN, SUMMARIZE], [SUM1]),
                 mk("main", "main", [SYS, TASK, SUM1], [EDIT]),          # context replaced
                 mk("main", "main", [SYS, TASK, SUM1, EDIT, TOOL], [DONE])])
    trajs = assemble(run)
    assert [(t.kind, t.origin) for t in trajs] == [
        ("main", "start"), ("summary", "start"), ("main", "compaction")]
    assert trajs[2].token_ids.tolist() == [SYS, TASK, SUM1, EDIT, TOOL, DONE]
    # SUM1 is context in the new main trajectory: only EDIT and DONE are its own
    assert trajs[2].generated_mask().tolist() == [0, 0, 0, 1, 0, 1]


def test_subagent_is_its_own_trajectory_with_its_parent():
    run = mkrun([mk("main", "main", [SYS, TASK], [LOOK]),
                 mk("sub1", "subagent", [SYS, SUBTASK], [FOUND], parent="main"),
                 mk("main", "main", [SYS, TASK, LOOK, RESULT], [DONE])])
    main, sub = assemble(run)
    assert main.call_indices == (0, 2)
    assert (sub.agent_id, sub.parent_agent_id, sub.rank) == ("sub1", "main", 2)


def test_retry_repeats_an_earlier_context_and_diverges():
    run = mkrun([mk("main", "main", [SYS, TASK], [PLAN]),
                 mk("main", "main", [SYS, TASK, PLAN, TOOL], [BAD]),       # malformed
                 mk("main", "main", [SYS, TASK, PLAN, TOOL], [FIX]),       # retry
                 mk("main", "main", [SYS, TASK, PLAN, TOOL, FIX, TOOL2], [DONE])])
    first, retry = assemble(run)
    assert first.token_ids.tolist() == [SYS, TASK, PLAN, TOOL, BAD]
    assert retry.origin == "retry" and retry.call_indices == (2, 3)
    assert retry.token_ids.tolist() == [SYS, TASK, PLAN, TOOL, FIX, TOOL2, DONE]


def test_the_longest_matching_trajectory_wins():
    run = mkrun([mk("main", "main", [SYS], [PLAN]),
                 mk("main", "main", [SYS, PLAN, TOOL], [EDIT]),
                 mk("main", "main", [SYS], [PLAN]),                       # retry: a 2nd chain
                 mk("main", "main", [SYS, PLAN, TOOL, EDIT, TOOL2], [DONE])])
    trajs = assemble(run)
    # the last call extends both [SYS PLAN] (chain 2) and [SYS PLAN TOOL EDIT] (chain 1)
    assert trajs[0].call_indices == (0, 1, 3)
    assert trajs[1].call_indices == (2,)


def test_agent_and_kind_must_match_to_join():
    run = mkrun([mk("a", "main", [SYS], [PLAN]),
                 mk("b", "main", [SYS, PLAN], [EDIT])])
    assert len(assemble(run)) == 2


def test_adjacent_views_are_joined_without_copy():
    buf = np.array([SYS, TASK, PLAN, EDIT], dtype=np.int32)
    joined = join_tokens(buf[:2], buf[2:4])
    assert np.shares_memory(joined, buf) and joined.tolist() == buf.tolist()
    apart = join_tokens(buf[:2], np.array([DONE], dtype=np.int32))
    assert not np.shares_memory(apart, buf) and apart.tolist() == [SYS, TASK, DONE]


def test_views_of_one_buffer_are_recognized_as_equal_contexts():
    buf = np.array([SYS, TASK, PLAN, TOOL, EDIT, 0, 0], dtype=np.int32)
    c1 = ModelCall("c1", "main", "main", buf[:2], buf[2:3], [-1.0], 0)
    c2 = ModelCall("c2", "main", "main", buf[:4], buf[4:5], [-1.0], 0)
    (t,) = assemble(mkrun([c1, c2]))
    assert np.shares_memory(t.token_ids, buf) and t.token_ids.tolist() == buf[:5].tolist()
