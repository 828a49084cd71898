"""Smoke run of benchmarks/endpoint.py: tiny budget, the table and the JSON shape."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "endpoint.py"


@pytest.mark.benchmark
@pytest.mark.slow
def test_endpoint_benchmark_smoke(tmp_path):
    out = tmp_path / "endpoint.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--runs", "2", "--turns", "2",
                           "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| path | calls | wall s | calls/s | trajectories/run | finished |" in proc.stdout
    data = json.loads(out.read_text())
    assert data["harness"]["calls"] == data["endpoint"]["calls"] == 6
    assert data["endpoint"]["trajectories_per_run"] == 1.0
    assert data["overhead_ms_p99"] >= data["overhead_ms_p50"] and data["throughput_ratio"] > 0
