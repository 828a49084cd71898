"""Tiny-budget smoke run of benchmarks/driver_bytes.py: one XLongAlgorithm step with the driver's
traffic counted; the table and JSON come out and the driver never fetches a run's tokens."""

from __future__ import annotations

import importlib.util
import json
import pathlib

import pytest

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "driver_bytes.py"

pytestmark = [pytest.mark.benchmark, pytest.mark.ray, pytest.mark.rllib, pytest.mark.slow]


def test_driver_bytes_smoke(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path / "ray"))
    spec = importlib.util.spec_from_file_location("driver_bytes_bench", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "out.json"
    mod.main(["--smoke", "--seed", "1", "--json", str(out)])
    data = json.loads(out.read_text())
    (step,) = data["steps"]
    assert step["runs"] == 8 and step["bytes_in"] > 0 and step["bytes_out"] > 0
    assert "Bytes through the driver" in capsys.readouterr().out
