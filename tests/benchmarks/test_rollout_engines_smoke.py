"""Smoke run of benchmarks/rollout_engines.py with a tiny budget (HF; vLLM too when marked)."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "rollout_engines.py"


def run(tmp_path, engines):
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--engines", engines,
                           "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "| tokens_per_s |" in proc.stdout
    return json.loads(out.read_text())


@pytest.mark.benchmark
def test_smoke_hf(tmp_path):
    data = run(tmp_path, "hf")
    (row,) = data["rows"]
    assert row["engine"] == "hf" and row["output_tokens"] > 0 and row["calls"] >= 2


@pytest.mark.benchmark
@pytest.mark.vllm
@pytest.mark.slow
def test_smoke_vllm_and_hf(tmp_path):
    pytest.importorskip("vllm")
    data = run(tmp_path, "vllm,hf")
    rows = {r["engine"]: r for r in data["rows"]}
    assert "error" not in rows["vllm"], rows["vllm"]
    assert rows["vllm"]["output_tokens"] == rows["hf"]["output_tokens"]   # same greedy runs
