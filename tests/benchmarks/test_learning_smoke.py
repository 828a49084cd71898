"""Smoke run of benchmarks/learning.py: tiny budget, the JSON shape and the table.

Two modes: colocated (the table's ratio base) and elastic; a mode is only a name passed to
``jobs.train.run_training``, and async cells are covered by the mode benchmarks' smoke runs and
the multi-node pool tests (a third mode here cost ~80 s of CI)."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import tempfile

import pytest

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "learning.py"


@pytest.mark.benchmark
@pytest.mark.ray
@pytest.mark.slow
def test_learning_smoke(tmp_path, warm_cache):
    out = tmp_path / "learning.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--modes", "colocated",
                           "elastic", "--json", str(out), "--workdir", str(warm_cache)],
                          capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, RAY_TMPDIR=tempfile.mkdtemp(prefix="rx", dir="/tmp")))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| mode | reward first 3 |" in proc.stdout
    data = json.loads(out.read_text())
    assert set(data["modes"]) == {"colocated", "elastic"}
    for mode in data["modes"].values():
        assert len(mode["rewards"]) == 2 and mode["seconds"] > 0
