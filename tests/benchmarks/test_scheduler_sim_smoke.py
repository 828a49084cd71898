"""Tiny-budget smoke run of benchmarks/scheduler_sim.py: table, JSON shape and plot."""

from __future__ import annotations

import importlib.util
import json
import pathlib

import pytest

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "scheduler_sim.py"


@pytest.mark.benchmark
def test_scheduler_sim_smoke(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("scheduler_sim", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out_json, png = tmp_path / "out.json", tmp_path / "timeline.png"
    mod.main(["--preset", "paper-2.4t", "--seed", "0", "--steps", "2", "--no-sweeps",
              "--json", str(out_json), "--plot", str(png), "--compare-seeds", "0", "1"])
    data = json.loads(out_json.read_text())
    assert data["preset"] == "paper-2.4t" and data["lower_bound_h"] > 0
    for mode in ("colocated", "async", "elastic", "forecast"):
        row = data["modes"][mode]
        assert row["makespan_h"] >= data["lower_bound_h"] and 0 <= row["gpu_idle_frac"] <= 1
    split = data["modes"]["best_static"]["split"]
    assert split["rollout_cells"] + split["training_cells"] == 8 and split["rollout_cells"] >= 1
    assert data["modes"]["best_static"]["speedup_vs_best_static"] == 1.0
    assert [r["seed"] for r in data["seed_comparison"]] == [0, 1]
    printed = capsys.readouterr().out
    assert "| mode | makespan h |" in printed and "forecast wins" in printed
    assert png.read_bytes()[:4] == b"\x89PNG"
