"""Readable token ids for tests: words that read as the conversation they stand for."""

from __future__ import annotations

from ray_xlong.trajectory import AgentRun, ModelCall

SYS, TASK, TOOL, TOOL2, SUMMARIZE, SUBTASK, RESULT = 100, 101, 102, 103, 104, 105, 106
PLAN, EDIT, TEST, DONE, BAD, FIX, SUM1, SUM2, LOOK, FOUND = 1, 2, 3, 4, 5, 6, 7, 8, 9, 10

_counter = iter(range(10**9))


def mk(agent, kind, inp, out, *, parent=None, version=0, lp=-0.5, call_id=None):
    """A ModelCall with logprob ``lp`` on every output token."""
    cid = call_id or f"c{next(_counter)}"
    return ModelCall(cid, agent, kind, list(inp), list(out), [lp] * len(out), version,
                     parent_agent_id=parent)


def mkrun(calls, *, run_id="r", group_id="g", reward=1.0, status="finished"):
    return AgentRun(run_id, group_id, calls, reward, status)
