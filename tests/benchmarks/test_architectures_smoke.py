"""Smoke run of benchmarks/architectures.py: two architectures, the table and the JSON shape."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "architectures.py"


@pytest.mark.benchmark
def test_architectures_smoke(tmp_path):
    out = tmp_path / "arch.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--seed", "1", "--archs", "llama",
                           "gemma2-softcap-sliding", "--grad-archs", "llama", "--json", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| architecture | HF class | tree (dense mask) |" in proc.stdout
    data = json.loads(out.read_text())
    assert data["exact"] and [r["arch"] for r in data["rows"]] == ["llama",
                                                                     "gemma2-softcap-sliding"]
    gemma2 = data["rows"][1]                    # sliding window + soft-capping: exact now
    assert isinstance(gemma2["xlong_tree"], float) and gemma2["xlong_tree"] <= data["tolerance"]
    assert gemma2["xlong_vs_dense"] <= data["tolerance"]
