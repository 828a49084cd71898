"""Smoke run of benchmarks/learning.py: tiny budget, the JSON shape and the table.

One mode, elastic: a mode is only a name passed to ``jobs.train.run_training`` (colocated and
async cells are covered by the mode benchmarks' smoke runs and the multi-node pool tests; each
mode here cost ~40 s of CI); the table's ratio to colocated is checked on a result of two
modes without a run. One step (``--smoke``): the multi-step elastic job runs end to end in
``tests/examples/test_train_elastic.py`` (the same ``run_training``, 6 steps)."""

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
    proc = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--modes", "elastic",
                           "--json", str(out), "--workdir", str(warm_cache)],
                          capture_output=True, text=True, timeout=600,
                          env=dict(os.environ,
                                   RAY_TMPDIR=tempfile.mkdtemp(prefix="rx", dir="/tmp")))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| mode | reward first 3 |" in proc.stdout
    data = json.loads(out.read_text())
    assert set(data["modes"]) == {"elastic"}
    for mode in data["modes"].values():
        assert len(mode["rewards"]) == 1 and mode["seconds"] > 0       # --smoke: one step


def test_the_table_gives_each_modes_time_against_colocated():
    sys.path.insert(0, str(SCRIPT.parents[1]))
    from benchmarks.learning import table

    def mode(seconds, rewards):
        return {"seeds": {"1": {"rewards": rewards}}, "final_mean": rewards[-1],
                "final_std": 0.0, "rise_mean": rewards[-1] - rewards[0], "seconds_mean": seconds}

    lines = table({"modes": {"colocated": mode(200.0, [0.1, 0.2, 0.3, 0.5]),
                             "elastic": mode(150.0, [0.1, 0.3, 0.3, 0.6])}}).splitlines()
    assert lines[2].endswith("| 200 | 1.00 |") and lines[3].endswith("| 150 | 0.75 |")
    assert "| elastic | 0.233 | 0.600 ± 0.000 | +0.500 |" in lines[3]
    alone = table({"modes": {"elastic": mode(150.0, [0.1, 0.3, 0.3, 0.6])}}).splitlines()
    assert alone[2].endswith("| 150 | - |")
