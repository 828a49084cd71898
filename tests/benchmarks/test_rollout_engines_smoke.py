"""Smoke run of benchmarks/rollout_engines.py with a tiny budget: HF and vLLM in one run (HF
alone where vLLM is not installed)."""

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
    for key in ("tokens_per_s", "prompt_tokens_per_s", "prefix_hit_rate", "peak_rss_mib"):
        assert f"| {key} |" in proc.stdout
    return json.loads(out.read_text())


def test_expected_cached_blocks():
    sys.path.insert(0, str(SCRIPT.parent))
    from rollout_engines import expected_cached

    class Call:
        def __init__(self, inp, out, start, end):
            self.input_ids, self.output_ids = list(inp), list(out)
            self.start_time, self.end_time = start, end

    shared = list(range(10))
    out0 = [60, 61, 62, 63, 64]
    calls = [Call(shared + [50, 51], out0, 0, 1),              # first: nothing cached
             Call(shared + [70, 71, 72], [80], 0, 1),          # same batch: call 0's prompt
             Call(shared + [50, 51] + out0[:4] + [90], [9], 2, 3)]   # call 0's next turn:
    hits, ceiling = expected_cached(calls, 4)                  # its output's block too
    assert hits == [0, 8, 16] and ceiling == [8, 12, 16]


def has_vllm() -> bool:
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


@pytest.mark.benchmark
@pytest.mark.slow
def test_smoke_hf_and_vllm(tmp_path):
    """One run of both engines on the same workload (HF alone where vLLM is not installed)."""
    data = run(tmp_path, "vllm,hf" if has_vllm() else "hf")
    rows = {r["engine"]: r for r in data["rows"]}
    hf = rows["hf"]
    assert hf["output_tokens"] > 0
    assert hf["calls"] == data["runs"] * data["calls"]          # no retries: one call per turn
    assert hf["system_prompt_tokens"] >= data["system_tokens"]
    assert hf["cached_tokens"] == 0 and hf["prefix_hit_rate"] == 0    # HF: no prefix cache
    # the workload shares whole blocks (multi-turn contexts over a long system prompt)
    assert 0 < hf["expected_hit_rate"] <= hf["block_ceiling_hit_rate"] < 1
    if not has_vllm():
        return
    assert "error" not in rows["vllm"], rows["vllm"]
    assert data["same_tokens"]                                           # same greedy runs
    assert rows["vllm"]["output_tokens"] == hf["output_tokens"]
    assert rows["vllm"]["block_size"] >= 16
    assert 0 < rows["vllm"]["prefix_hit_rate"] <= rows["vllm"]["block_ceiling_hit_rate"]
