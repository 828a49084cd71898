"""Tiny-budget smoke run of benchmarks/long_context.py (``--quick``): one tree row trained on 1
and 2 context-parallel ranks (gloo processes, no Ray), the spans all-gather and the ring, gives
the 1-rank logprobs and gradient."""

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
def test_long_context_quick(tmp_path):
    out = tmp_path / "out.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "long_context.py"),
                           "--quick", "--tokens", "1024", "--logprob-targets", "300",
                           "--vocab", "4096", "--exchange", "spans", "ring", "--json", str(out)],
                          env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    rows = {(r["tokens"], r["ranks"], r["exchange"]): r for r in data["rows"]}
    assert set(rows) == {(1024, 1, "-"), (1024, 2, "spans"), (1024, 2, "ring")}
    for exchange in ("spans", "ring"):
        two = rows[(1024, 2, exchange)]
        assert two["peak_bytes_per_rank"] > 0 and two["step_s"] > 0
        assert two["max_abs_logprob_diff"] <= 1e-4 and two["max_rel_grad_diff"] <= 1e-4
    assert data["plans"][0]["pieces"] > 1
    assert data["chunked_logprobs"]["peak_bytes"] > 0
    assert "peak MB / rank" in proc.stdout
