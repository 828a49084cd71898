"""Hypothesis strategies: runs that branch in every way assembly must handle.

Each call picks an agent (main / main's summary / a subagent) and a context: an extension of an
earlier context of the same agent (joins), a cut of any earlier context (retry or compaction), or
a fresh one. The vocabulary is tiny so that branches collide and share prefixes often.
"""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

from ray_xlong.trajectory import AgentRun, ModelCall
from ray_xlong.trajectory.synthetic import SyntheticConfig, synthetic_runs

AGENTS = [("main", "main", None), ("main", "summary", None), ("sub1", "subagent", "main"),
          ("sub2", "subagent", "main")]
VOCAB = 5


@st.composite
def branching_run(draw, run_id: str = "r", group_id: str = "g") -> AgentRun:
    tokens = st.lists(st.integers(0, VOCAB - 1), min_size=0, max_size=3)
    contexts: list[tuple[int, list[int]]] = []          # (agent index, context after the call)
    calls = []
    for i in range(draw(st.integers(1, 9))):
        a = draw(st.integers(0, len(AGENTS) - 1)) if i else 0
        agent, kind, parent = AGENTS[a]
        own = [ctx for ai, ctx in contexts if ai == a]
        how = draw(st.sampled_from(["extend", "cut", "fresh"]))
        if how == "extend" and own:
            inp = draw(st.sampled_from(own)) + draw(tokens)
        elif how == "cut" and contexts:
            ctx = draw(st.sampled_from([c for _, c in contexts]))
            inp = ctx[:draw(st.integers(1, len(ctx)))] + draw(tokens)
        else:
            inp = [draw(st.integers(0, VOCAB - 1))] + draw(tokens)
        out = draw(tokens)
        lp = -(i + 1) / 100.0                             # identifies the generating call
        calls.append(ModelCall(f"c{i}", agent, kind, inp, out, [lp] * len(out), i % 3,
                               parent_agent_id=parent))
        contexts.append((a, inp + out))
    if not any(c.kind == "main" for c in calls[:1]):
        raise AssertionError("first call is main by construction")
    reward = draw(st.floats(-1, 1))
    status = draw(st.sampled_from(["finished", "timeout"]))
    return AgentRun(run_id, group_id, calls, reward, status)


@st.composite
def run_batches(draw) -> list[AgentRun]:
    """1-3 branching runs in 1-2 groups, or a batch of small synthetic runs."""
    if draw(st.booleans()):
        seed = draw(st.integers(0, 2**16))
        return synthetic_runs(seed, groups=2, runs_per_group=2, config=SyntheticConfig.small())
    n = draw(st.integers(1, 3))
    return [draw(branching_run(run_id=f"r{i}", group_id=f"g{i % 2}")) for i in range(n)]


def as_array_calls(run: AgentRun) -> AgentRun:
    """The same run with ids as int32 numpy arrays (the zero-copy code path)."""
    calls = [ModelCall(c.call_id, c.agent_id, c.kind, np.asarray(c.input_ids, np.int32),
                       np.asarray(c.output_ids, np.int32), c.output_logprobs, c.policy_version,
                       parent_agent_id=c.parent_agent_id) for c in run.calls]
    return AgentRun(run.run_id, run.group_id, calls, run.reward, run.status)
