"""Tiny-budget smoke run of benchmarks/long_run.py: one process (``--smoke``: 12 calls) runs
harness and endpoint on ChatML and Llama-3, windowed and exact rule, each with its cost at call
10, and (``--train-steps 6``) a short long_horizon run through the harness whose tree trains on
1 and 2 context-parallel ranks (gloo processes) to the same logprobs and gradients.

Both parts share one interpreter's imports (they were two runs); ``--calls 0`` (train only, no
rows) is checked on the script's ``run`` in this process."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

from tests.shared import load_script

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "long_run.py"


@pytest.mark.benchmark
@pytest.mark.slow
def test_long_run_smoke_and_train(tmp_path):
    out = tmp_path / "out.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--result-chars", "400",
                           "--train-steps", "6", "--json", str(out)],
                          env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    rows = {(r["template"], r["side"], r["rule"]): r for r in data["rows"]}
    assert set(rows) == {(t, s, r) for t in ("chatml", "llama3")
                         for s in ("harness", "endpoint") for r in ("windowed", "exact")}
    for (_, _, rule), row in rows.items():
        assert row["calls"] == 12 and row["ms_at"]["10"] > 0, row
        stats = row["delta_stats"]
        assert stats["mismatches"] == 0 and stats["unproven"] == 0, row
        assert (stats["windowed"] >= 9) == (rule == "windowed"), row
    assert "| chatml | harness | windowed |" in proc.stdout
    train = data["train"]
    assert train["calls"] == 6 + 2 * 2 + 1                 # a call a step, 2 delegated (+2 each)
    assert train["targets"] > 0 and train["row_tokens"] > train["targets"]
    assert train["max_abs_logprob_diff"] <= 1e-4 and train["max_rel_grad_diff"] <= 1e-4
    assert "long run: 6 steps" in proc.stdout


def test_no_calls_gives_no_rows(capsys):
    """``--calls 0`` (a train-only run): no template, side or rule is measured, and the table
    is left out."""
    mod = load_script(SCRIPT, "long_run_bench")
    result = mod.run(calls=0, exact_calls=12, chars=400)
    assert result["rows"] == [] and result["calls"] == 0
    mod.show(result)
    assert capsys.readouterr().out == ""
