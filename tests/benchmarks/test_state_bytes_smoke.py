"""Tiny-budget smoke run of benchmarks/state_bytes.py (``--quick``): two model sizes, 3
single-Learner cells (one sits step 0 out and joins step 1), 2 elastic steps; the table and
JSON come out, the driver's bytes do not follow the model and no step fell back to the object
store."""

from __future__ import annotations

import json
import pathlib
import tempfile

import pytest

from tests.shared import load_script

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "state_bytes.py"

pytestmark = [pytest.mark.benchmark, pytest.mark.ray, pytest.mark.rllib, pytest.mark.slow]


def test_state_bytes_smoke(tmp_path, capsys, monkeypatch):
    # a short temp dir: Ray's socket paths must stay under 107 bytes (pytest's tmp_path is long)
    monkeypatch.setenv("RAY_TMPDIR", tempfile.mkdtemp(prefix="rx", dir="/tmp"))
    mod = load_script(SCRIPT, "state_bytes_bench")
    out = tmp_path / "out.json"
    mod.main(["--quick", "--seed", "1", "--json", str(out)])
    data = json.loads(out.read_text())
    small, large = data["rows"]
    assert data["cells"] == 3 and all(r["cells"] == 3 for r in data["rows"])
    assert large["params"] > 5 * small["params"]
    for row in data["rows"]:
        assert row["fallbacks"] == 0 and row["driver_bytes_per_step"] < 1e6
        assert {"params", "driver_bytes_per_step", "max_learner_bytes_per_step",
                "driver_peak_rss_bytes"} <= set(row)
    # the driver's bytes do not grow with the model (the state never passes through it)
    assert large["driver_bytes_per_step"] <= 1.5 * small["driver_bytes_per_step"]
    assert [p["model"] for p in data["projection"]] == ["1.5B", "8B", "32B", "70B", "2.4T"]
    assert "Projection" in capsys.readouterr().out
