"""Tiny-budget smoke run of benchmarks/long_run.py (``--smoke``: 12 calls): harness and
endpoint on ChatML and Llama-3, windowed and exact rule, each with its cost at call 10."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.benchmark
@pytest.mark.slow
def test_long_run_smoke(tmp_path):
    out = tmp_path / "out.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "long_run.py"), "--smoke",
                           "--result-chars", "400", "--json", str(out)],
                          env=env, capture_output=True, text=True, timeout=600)
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


@pytest.mark.benchmark
@pytest.mark.slow
def test_long_run_train_smoke(tmp_path):
    """A short long_horizon run through the harness, its tree trained on 1 and 2
    context-parallel ranks (gloo processes): the same logprobs and gradients."""
    out = tmp_path / "out.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "long_run.py"),
                           "--calls", "0", "--train-steps", "6", "--json", str(out)],
                          env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["rows"] == []
    train = data["train"]
    assert train["calls"] == 6 + 2 * 2 + 1                 # a call a step, 2 delegated (+2 each)
    assert train["targets"] > 0 and train["row_tokens"] > train["targets"]
    assert train["max_abs_logprob_diff"] <= 1e-4 and train["max_rel_grad_diff"] <= 1e-4
