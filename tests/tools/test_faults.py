"""The fault suite (issue 7), also the tiny-budget smoke run of ``benchmarks/faults.py``.

On a ``ray.cluster_utils`` cluster (a head node and one worker node per cell) every fault kind
is injected at seeded random points of an elastic job: runner and learner actors killed
(``ray.kill``), a cell's node removed and later replaced, the driver process SIGKILLed after a
checkpoint and resumed by a new driver. Each job is audited from its event log and trained-run
ids: every run of the job trained exactly once, the last step reached with versions 1..N in
order, the cell invariants held, and the fault was seen and recovered from.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "faults.py"

pytestmark = [pytest.mark.faults, pytest.mark.multinode, pytest.mark.ray, pytest.mark.slow,
              pytest.mark.benchmark]


@pytest.mark.timeout(1500)
def test_every_fault_kind_loses_nothing(tmp_path):
    out = tmp_path / "faults.json"
    # 2 cells (the fewest where a lost cell's work moves to another), 3 steps, the runner,
    # learner and node faults in one job (--together): CI time
    proc = subprocess.run([sys.executable, str(SCRIPT), "--per-kind", "1", "--steps", "3",
                           "--cells", "2", "--seed", "7", "--together", "--json", str(out)],
                          capture_output=True, text=True, timeout=1400)
    assert out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {r["kind"]: r for r in json.loads(out.read_text())["faults"]}
    assert set(rows) == {"runner", "learner", "node", "driver"}
    assert rows["runner"]["job_s"] == rows["learner"]["job_s"] == rows["node"]["job_s"]  # 1 job
    for kind, r in rows.items():
        assert r["injected"] == 1 and r["detected"] == 1, r       # the fault really happened
        assert r["runs_lost"] == 0 and r["runs_trained_twice"] == 0, r
        assert r["versions_consistent"] and r["steps"] == 3 and not r["violations"], r
        assert r["survived"] == r["injected"], r
        assert r["recover_s"] is not None and r["recover_s"] > 0, r
    assert rows["driver"]["runs_from_spool"] + rows["driver"]["runs_rerun"] >= 0
    assert proc.returncode == 0, proc.stdout[-2000:]
    assert "fault    injected survived" in proc.stdout                 # the table is printed


@pytest.mark.timeout(900)
def test_a_rank_lost_inside_a_sharded_step_loses_nothing(tmp_path):
    """2 cells whose Learners are 2 FSDP2 ranks (gloo): one rank of a training cell is killed
    mid-step; the cell is replaced, its share of the step redone, every run trained once."""
    out = tmp_path / "faults.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--kinds", "learner", "--per-kind", "1",
                           "--steps", "2", "--cells", "2", "--ranks-per-cell", "2",
                           "--seed", "7", "--json", str(out)], capture_output=True, text=True,
                          timeout=800)
    assert out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    (r,) = json.loads(out.read_text())["faults"]
    assert r["kind"] == "learner" and r["injected"] == 1 and r["detected"] == 1, r
    assert len(r["ranks_killed"]) == 1, r                   # one rank, not the whole cell
    assert r["micro_batches_redone"] >= 1, r                # killed mid micro-batch: redone
    assert r["runs_lost"] == 0 and r["runs_trained_twice"] == 0, r
    assert r["versions_consistent"] and r["steps"] == 2 and not r["violations"], r
    assert r["survived"] == 1 and proc.returncode == 0, proc.stdout[-2000:]
