"""Tiny-budget smoke run of benchmarks/modes_ray.py: real Ray cells, the modes, the simulator on
the same workload; table, JSON shape and one timeline PNG per mode.

``async`` is not run on its own: at this size (2 cells, ``async_rollout=1``) ``best_static``'s
real job is the async job with the same 1 / 1 split (``mode_bench.mode_policy``), so it runs
the async path on cells; elastic and forecast also run on cells in ``bench --backend ray``
(``tests/examples/test_examples_on_one_ray.py``)."""

from __future__ import annotations

import json
import pathlib

import pytest

from tests.shared import load_script

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "modes_ray.py"


@pytest.mark.benchmark
@pytest.mark.ray
@pytest.mark.slow
def test_modes_ray_smoke(tmp_path, capsys):
    mod = load_script(SCRIPT, "modes_ray")
    out_json, plots = tmp_path / "out.json", tmp_path / "plots"
    mod.main(["--smoke", "--seed", "0", "--json", str(out_json), "--plot-dir", str(plots),
              "--modes", "colocated", "elastic", "best_static"])
    data = json.loads(out_json.read_text())
    assert set(data["modes"]) == {"colocated", "elastic", "best_static"}
    assert data["modes"]["best_static"]["split"]["rollout_cells"] == 1   # 2 cells: 1 / 1
    for mode, row in data["modes"].items():
        assert row["makespan_s"] > 0 and row["sim_makespan_s"] > 0
        assert 0 < row["gpu_busy_frac"] <= 1
        assert row["violations"] == [] and row["placement_groups_created"] == data["cells"]
        assert row["switch_s_max"] > 0         # a timing: measured and printed, not asserted
        assert (plots / f"modes_ray_{mode}.png").read_bytes()[:4] == b"\x89PNG"
    assert "| mode | makespan s | sim s |" in capsys.readouterr().out
