"""Recording: runs round-trip through JSONL token-exactly, stored as context deltas."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings

from ray_xlong.trajectory import ProcessorConfig, RecordError, TrajectoryProcessor
from ray_xlong.trajectory.recording import read_runs, run_records, write_runs
from ray_xlong.trajectory.synthetic import SyntheticConfig, synthetic_runs
from tests.trajectory.strategies import branching_run
from tests.trajectory.words import EDIT, PLAN, SYS, TASK, TOOL, mk, mkrun


def same_run(a, b):
    assert (a.run_id, a.group_id, a.reward, a.status) == (b.run_id, b.group_id, b.reward,
                                                          b.status)
    assert len(a.calls) == len(b.calls)
    for x, y in zip(a.calls, b.calls):
        assert (x.call_id, x.agent_id, x.kind, x.parent_agent_id, x.policy_version) == (
            y.call_id, y.agent_id, y.kind, y.parent_agent_id, y.policy_version)
        assert x.input_ids.tolist() == y.input_ids.tolist()
        assert x.output_ids.tolist() == y.output_ids.tolist()
        assert np.allclose(x.output_logprobs, y.output_logprobs)


def test_context_is_stored_as_a_delta():
    run = mkrun([mk("main", "main", [SYS, TASK], [PLAN]),
                 mk("main", "main", [SYS, TASK, PLAN, TOOL], [EDIT])])
    _, first, second = run_records(run)
    assert first["input"] == {"base": None, "shared": 0, "suffix": [SYS, TASK]}
    assert second["input"] == {"base": first["call_id"], "shared": 3, "suffix": [TOOL]}


@pytest.mark.parametrize("suffix", [".jsonl", ".jsonl.gz"])
def test_synthetic_runs_round_trip(tmp_path, suffix):
    runs = synthetic_runs(2, groups=2, runs_per_group=3, config=SyntheticConfig.small())
    path = str(tmp_path / f"runs{suffix}")
    assert write_runs(path, runs) == 6
    back = read_runs(path)
    for a, b in zip(runs, back):
        same_run(a, b)
    cfg = ProcessorConfig(pack="tree")
    assert TrajectoryProcessor(cfg).process(runs).stats == TrajectoryProcessor(cfg).process(
        back).stats


@settings(max_examples=60, deadline=None)
@given(branching_run())
def test_branching_runs_round_trip(tmp_path_factory, run):
    path = str(tmp_path_factory.mktemp("rec") / "runs.jsonl")
    write_runs(path, [run])
    (back,) = read_runs(path)
    same_run(run, back)


def test_read_runs_share_one_buffer_along_a_chain(tmp_path):
    run = mkrun([mk("main", "main", [SYS, TASK], [PLAN]),
                 mk("main", "main", [SYS, TASK, PLAN, TOOL], [EDIT])])
    path = str(tmp_path / "r.jsonl")
    write_runs(path, [run])
    (back,) = read_runs(path)
    assert np.shares_memory(back.calls[0].input_ids, back.calls[1].input_ids)


@pytest.mark.parametrize("mutate, message", [
    pytest.param(lambda recs: recs[2]["input"].update(base="ghost"), "input.base",
                 id="unknown-base"),
    pytest.param(lambda recs: recs[2]["input"].update(shared=99), "input.shared",
                 id="shared-too-long"),
    pytest.param(lambda recs: recs[1].pop("kind"), "malformed", id="missing-field"),
    pytest.param(lambda recs: recs[1].update(type="step"), "type", id="unknown-type"),
    pytest.param(lambda recs: recs.pop(), "truncated", id="truncated-run"),
    pytest.param(lambda recs: recs[1].update(output_logprobs=[0.5]), "output_logprobs",
                 id="bad-record-inside"),
])
def test_bad_files_name_the_line(tmp_path, mutate, message):
    run = mkrun([mk("main", "main", [SYS, TASK], [PLAN]),
                 mk("main", "main", [SYS, TASK, PLAN, TOOL], [EDIT])])
    recs = list(run_records(run))
    mutate(recs)
    path = tmp_path / "bad.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    with pytest.raises(RecordError, match=message):
        read_runs(str(path))
