"""Tiny-budget smoke run of benchmarks/trajectory_processor.py: tables and JSON shape."""

from __future__ import annotations

import json
import pathlib

import pytest

from tests.shared import load_script

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "trajectory_processor.py"


@pytest.mark.benchmark
@pytest.mark.slow
def test_trajectory_processor_smoke(tmp_path, capsys):
    mod = load_script(SCRIPT, "trajectory_processor_bench")
    out = tmp_path / "out.json"
    mod.main(["--smoke", "--seed", "1", "--json", str(out)])
    data = json.loads(out.read_text())
    paper = data["paper_run"]
    assert paper["process_none_s"] > 0 and paper["process_tree_peak_bytes"] > 0
    before, after = data["dedup"]
    assert after["trajectories"] <= 5 and after["unique_tokens"] <= before["unique_tokens"]
    (step,) = data["train_steps"]
    assert step["unique_tokens"] < step["total_tokens"] and step["speedup"] > 0
    assert abs(step["loss_tree"] - step["loss_per_trajectory"]) < 1e-4
    text = capsys.readouterr().out
    assert "## 2. Dedup" in text and "ratio to bound" in text
