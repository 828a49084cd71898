"""Smoke run of benchmarks/endpoint.py: tiny budget, every engine, the tables and the JSON shape.

Seed 1 with ``--quick-warm``: the same warm-started policy (seed, warm start, chat style) as
the learning benchmark's and the openai_agent example's smoke runs, built once in the shared
``warm_cache``; one repeat (the repeats' loop runs the same path each time)."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "endpoint.py"


@pytest.mark.benchmark
@pytest.mark.slow
def test_endpoint_benchmark_smoke(tmp_path, warm_cache):
    out = tmp_path / "endpoint.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--runs", "2", "--turns", "2",
                           "--repeats", "1", "--seed", "1",
                           "--engines", "scripted,hf,compute", "--compute-model", "128x2",
                           "--quick-warm", "--workdir",
                           str(warm_cache), "--json", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| engine | path | calls | tokens | median wall s | calls/s | tokens/s |" in proc.stdout
    assert "| engine | overhead p50 ms (one run) |" in proc.stdout
    data = json.loads(out.read_text())
    scripted, hf, compute = data["scripted"], data["hf"], data["compute"]
    # 1 repeat × 2 runs × 3 calls (2 tool turns and the answer)
    for res in (scripted, compute):
        assert res["harness"]["calls"] == res["endpoint"]["calls"] == 6
        assert res["endpoint"]["trajectories_per_run"] == 1.0
    assert hf["endpoint"]["calls"] >= 2 and hf["harness"]["calls"] >= 2
    for res in (scripted, hf, compute):
        assert res["overhead_ms_p99"] >= res["overhead_ms_p50"] and res["throughput_ratio"] > 0
        assert set(res["endpoint"]["cpu_s_per_batch"]) == {"clients", "endpoint"}
        assert set(res["harness"]["cpu_s_per_batch"]) == {"harness"}
        assert res["endpoint"]["cpu_s_per_batch"]["endpoint"] > 0 and res["cpu_bound_ratio"] > 0
