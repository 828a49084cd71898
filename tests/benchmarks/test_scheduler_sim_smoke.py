"""Tiny-budget smoke run of benchmarks/scheduler_sim.py: table, JSON shape and plot."""

from __future__ import annotations

import json
import pathlib

import pytest

from tests.shared import load_script

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "scheduler_sim.py"


@pytest.mark.benchmark
def test_scheduler_sim_smoke(tmp_path, capsys):
    mod = load_script(SCRIPT, "scheduler_sim")
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


@pytest.mark.benchmark
def test_scheduler_sim_sweep_rows_carry_best_static_and_planned(tmp_path, capsys):
    mod = load_script(SCRIPT, "scheduler_sim")
    out_json = tmp_path / "sweeps.json"
    mod.main(["--preset", "paper-2.4t-shift", "--seed", "0", "--steps", "2", "--sweeps-only",
              "--points", "cells=4", "staleness bound=1", "--json", str(out_json)])
    rows = json.loads(out_json.read_text())["sweeps"]
    assert [(r["sweep"], r["value"]) for r in rows] == [("cells", "4"), ("staleness bound", "1")]
    for r in rows:
        best = min(r[k] for k in ("colocated_h", "async_h", "elastic_h", "best_static_h"))
        assert r["best_static_h"] <= r["async_h"] and 1 <= r["best_static_rollout_cells"]
        assert r["planned_vs_best_baseline"] == pytest.approx(r["planned_h"] / best)
        assert r["planned_plans"] >= 1 and r["planned_plan_wall_s_max"] > 0
    assert "| planned h |" in capsys.readouterr().out
    mod.main(["--preset", "paper-2.4t", "--bounds"])
    assert "| cells | 32 |" in capsys.readouterr().out


@pytest.mark.benchmark
def test_scheduler_sim_gap_splits_the_makespan_into_the_window_parts(tmp_path, capsys):
    mod = load_script(SCRIPT, "scheduler_sim")
    out = mod.main(["--preset", "paper-2.4t", "--seed", "0", "--steps", "2", "--gap",
                    "--points", "cells=4"])
    rows = out["gap"]
    assert {r["mode"].split(" ")[0] for r in rows} == {"planned", "forecast", "best_static"}
    for r in rows:
        assert r["full_window_h"] + r["not_full_h"] == pytest.approx(r["makespan_h"])
        assert r["makespan_h"] >= r["bound_admission_h"] - 1e-9
    assert "| cells 4 | planned |" in capsys.readouterr().out
