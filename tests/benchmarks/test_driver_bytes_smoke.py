"""Tiny-budget smoke run of benchmarks/driver_bytes.py: one XLongAlgorithm step with the driver's
traffic counted (2 groups × 2 runs); the table and JSON come out and the driver never fetches a
run's tokens."""

from __future__ import annotations

import json
import pathlib
import tempfile

import pytest

from tests.shared import load_script

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "driver_bytes.py"

pytestmark = [pytest.mark.benchmark, pytest.mark.ray, pytest.mark.rllib, pytest.mark.slow]


def test_driver_bytes_smoke(tmp_path, capsys, monkeypatch):
    # a short temp dir: Ray's socket paths must stay under 107 bytes (pytest's tmp_path is long)
    monkeypatch.setenv("RAY_TMPDIR", tempfile.mkdtemp(prefix="rx", dir="/tmp"))
    mod = load_script(SCRIPT, "driver_bytes_bench")
    out = tmp_path / "out.json"
    mod.main(["--smoke", "--seed", "1", "--runs-per-group", "2", "--json", str(out)])
    data = json.loads(out.read_text())
    (step,) = data["steps"]
    assert step["runs"] == 4 and step["bytes_in"] > 0 and step["bytes_out"] > 0
    assert "Bytes through the driver" in capsys.readouterr().out
