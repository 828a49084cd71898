"""ModelCall / AgentRun validation: every malformed input names its field and run / call."""

from __future__ import annotations

import numpy as np
import pytest

from ray_xlong.trajectory import (AgentRun, ModelCall, ProcessorConfig, RecordError,
                                  TrajectoryProcessor)
from ray_xlong.trajectory.records import check_run

SYS, USER, HELLO, WORLD = 100, 101, 1, 2


def call(**overrides):
    fields = dict(call_id="c1", agent_id="main", kind="main", input_ids=[SYS, USER],
                  output_ids=[HELLO, WORLD], output_logprobs=[-0.1, -0.2], policy_version=0,
                  run_id="r1")
    fields.update(overrides)
    return ModelCall(**fields)


def run(calls=None, **overrides):
    fields = dict(run_id="r1", group_id="g1", calls=calls or [call()], reward=1.0,
                  status="finished")
    fields.update(overrides)
    return AgentRun(**fields)


BAD_CALLS = [
    pytest.param(dict(output_logprobs=[-0.1]), "output_logprobs", id="logprob-length-mismatch"),
    pytest.param(dict(input_ids=[]), "input_ids", id="empty-input"),
    pytest.param(dict(input_ids=[SYS, -3]), "input_ids", id="negative-id"),
    pytest.param(dict(input_ids=[SYS, 1.5]), "input_ids", id="float-id"),
    pytest.param(dict(input_ids=np.array([1.0, 2.0])), "input_ids", id="float-array"),
    pytest.param(dict(input_ids=np.array([[1, 2]])), "input_ids", id="2d-array"),
    pytest.param(dict(input_ids="hello"), "input_ids", id="text-instead-of-ids"),
    pytest.param(dict(output_ids=[HELLO, True]), "output_ids", id="bool-id"),
    pytest.param(dict(output_logprobs=[-0.1, 0.5]), "output_logprobs", id="positive-logprob"),
    pytest.param(dict(output_logprobs=[-0.1, float("nan")]), "output_logprobs", id="nan-logprob"),
    pytest.param(dict(output_logprobs=[-0.1, -float("inf")]), "output_logprobs",
                 id="inf-logprob"),
    pytest.param(dict(kind="planner"), "kind", id="unknown-kind"),
    pytest.param(dict(kind="subagent"), "parent_agent_id", id="subagent-without-parent"),
    pytest.param(dict(policy_version=-1), "policy_version", id="negative-version"),
    pytest.param(dict(policy_version=1.0), "policy_version", id="float-version"),
    pytest.param(dict(call_id=""), "call_id", id="empty-call-id"),
    pytest.param(dict(agent_id=None), "agent_id", id="missing-agent-id"),
    pytest.param(dict(parent_agent_id="main"), "parent_agent_id", id="own-parent"),
]


@pytest.mark.parametrize("overrides, field", BAD_CALLS)
def test_bad_call_names_field_and_call(overrides, field):
    with pytest.raises(RecordError) as err:
        call(**overrides)
    assert field in str(err.value)
    if "call_id" not in overrides:
        assert "'c1'" in str(err.value) and "'r1'" in str(err.value)


BAD_RUNS = [
    pytest.param(dict(status="crashed"), "status", id="unknown-status"),
    pytest.param(dict(reward=float("nan")), "reward", id="nan-reward"),
    pytest.param(dict(reward=float("inf")), "reward", id="inf-reward"),
    pytest.param(dict(reward="1.0"), "reward", id="string-reward"),
    pytest.param(dict(group_id=""), "group_id", id="empty-group"),
    pytest.param(dict(calls=[call(), call()]), "call_id", id="duplicate-call-id"),
    pytest.param(dict(calls=[call(), call(call_id="c2", agent_id="sub", kind="subagent",
                                          parent_agent_id="ghost")]),
                 "parent_agent_id", id="parent-does-not-exist"),
    pytest.param(dict(calls=[call(call_id="c0", agent_id="sub", kind="subagent",
                                  parent_agent_id="main"),
                             call(call_id="c2", agent_id="sub", kind="subagent",
                                  parent_agent_id="other"),
                             call(call_id="c3", agent_id="other")]),
                 "parent_agent_id", id="agent-changes-parent"),
    pytest.param(dict(calls=[{"call_id": "c1"}]), "calls[0]", id="dict-instead-of-call"),
]


@pytest.mark.parametrize("overrides, field", BAD_RUNS)
def test_bad_run_names_field_and_run(overrides, field):
    with pytest.raises(RecordError) as err:
        run(**overrides)
    assert field in str(err.value)
    assert "'r1'" in str(err.value)


def test_duplicate_run_ids_in_a_batch_are_rejected():
    with pytest.raises(RecordError, match=r"run 'r1': run_id is duplicated"):
        TrajectoryProcessor(ProcessorConfig(pack="none")).process([run(), run()])


def test_non_run_in_a_batch_is_rejected():
    with pytest.raises(RecordError, match=r"runs\[1\] is a dict"):
        TrajectoryProcessor(ProcessorConfig(pack="none")).process([run(), {"run_id": "x"}])


def test_numpy_ids_are_kept_without_copy_and_frozen():
    buf = np.arange(10, dtype=np.int32)
    c = call(input_ids=buf[:4], output_ids=buf[4:6])
    assert np.shares_memory(c.input_ids, buf) and np.shares_memory(c.output_ids, buf)
    assert not c.input_ids.flags.writeable
    assert buf.flags.writeable                      # the caller's buffer is left alone
    with pytest.raises(AttributeError):
        c.kind = "summary"


def test_list_ids_become_int_arrays():
    c = call()
    assert c.input_ids.dtype == np.int64 and c.input_ids.tolist() == [SYS, USER]
    assert c.context_len == 4
    assert "in=2, out=2" in repr(c)


def test_empty_output_is_allowed():
    c = call(output_ids=[], output_logprobs=[])
    assert c.output_ids.size == 0


def test_main_agent_may_also_make_summary_calls():
    r = run(calls=[call(), call(call_id="c2", kind="summary")])
    assert [c.kind for c in r.calls] == ["main", "summary"]


def test_a_context_prefix_view_scans_only_its_new_ids():
    """Calls whose inputs are prefix views of one append-only buffer (the harness's Context,
    the endpoint's IdBuffer): each call's range check reads only the ids appended since the
    last one, a bad new id is still refused, and a shorter prefix stays valid after it."""
    from ray_xlong.rollout.context import Context
    from ray_xlong.serving.prompts import IdBuffer

    ctx = Context(np.array([SYS, USER]), capacity=64)
    call(input_ids=ctx.view())
    ctx.append(np.array([HELLO, WORLD]))
    ctx.buf[0] = -7            # against the contract (never rewritten), so never read again:
    call(input_ids=ctx.view())  # proof that the scanned prefix is not scanned again
    ctx.buf[0] = SYS
    ctx.append(np.array([HELLO, -1]))
    with pytest.raises(RecordError, match="input_ids holds a negative id"):
        call(input_ids=ctx.view())
    call(input_ids=ctx.view()[:4])           # the valid prefix before the bad id
    call(input_ids=ctx.view()[:3])
    with pytest.raises(RecordError, match="negative id"):
        call(input_ids=np.array([SYS, -1]))  # an array of no registered buffer: scanned whole

    buf = IdBuffer(np.array([SYS, USER]))
    call(input_ids=buf.view())
    buf = buf.extended(2, np.arange(3000) % 50)        # grows: the scanned prefix carries over
    call(input_ids=buf.view())
    buf.buf[1] = -7
    buf = buf.extended(buf.end, np.array([HELLO]))
    call(input_ids=buf.view())
    buf.buf[1] = USER
    buf = buf.extended(buf.end, np.array([HELLO, 10**6]))
    with pytest.raises(RecordError, match="id 1000000, outside the vocabulary"):
        check_run(run(calls=[call(input_ids=buf.view())]), vocab_size=1000)


def test_the_engine_input_check_reads_only_new_ids_of_a_context():
    from ray_xlong.rollout.context import Context
    from ray_xlong.rollout.engine import check_input_ids

    ctx = Context(np.array([3, 4]), capacity=16)
    check_input_ids(ctx.view(), vocab_size=10)
    ctx.append(np.array([5, 12]))
    with pytest.raises(ValueError, match=r"\[3, 12\]"):
        check_input_ids(ctx.view(), vocab_size=10)
    check_input_ids(ctx.view()[:3], vocab_size=10)
