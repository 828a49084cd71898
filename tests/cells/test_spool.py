"""The run spool: a run is spooled atomically (its ``.jsonl`` last), read back token-exact with
its info, and discarded by id; half-written files are ignored."""

from __future__ import annotations

import numpy as np

from ray_xlong.cells.spool import RunSpool
from ray_xlong.rollout.run_records import RunInfo, RunResult
from ray_xlong.trajectory.synthetic import synthetic_runs


def test_spool_round_trip_and_discard(tmp_path):
    runs = synthetic_runs(0, groups=1, runs_per_group=3)
    spool = RunSpool(tmp_path / "s")
    for i, run in enumerate(runs):
        spool.put(i, RunResult(run, RunInfo("answer", 0, 0, 0, 0, 0, 1.5)))
    (tmp_path / "s" / ".r9.123.tmp.jsonl").write_text("{half")  # a writer that died
    assert spool.run_ids() == {r.run_id for r in runs}
    got = spool.get([runs[1].run_id, "missing"])
    cell, res = got[runs[1].run_id]
    assert cell == 1 and res.info.stop_reason == "answer" and res.run.reward == runs[1].reward
    for a, b in zip(res.run.calls, runs[1].calls):
        np.testing.assert_array_equal(a.input_ids, b.input_ids)
        np.testing.assert_array_equal(a.output_ids, b.output_ids)
    spool.discard([runs[0].run_id])
    assert spool.run_ids() == {runs[1].run_id, runs[2].run_id}
