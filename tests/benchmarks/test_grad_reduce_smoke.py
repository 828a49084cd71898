"""Tiny-budget smoke run of benchmarks/grad_reduce.py: every scheme gives every member the
same sum, and the object-store schemes other than ``all`` move one gradient into a member."""

from __future__ import annotations

import importlib.util
import json
import pathlib

import pytest

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "grad_reduce.py"


@pytest.mark.benchmark
@pytest.mark.ray
@pytest.mark.slow
def test_grad_reduce_smoke(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("grad_reduce_bench", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "out.json"
    mod.main(["--smoke", "--seed", "1", "--json", str(out)])
    data = json.loads(out.read_text())
    schemes = data["schemes"]
    assert set(schemes) == {"all", "tree", "leader", "gloo"}
    assert schemes["all"]["member_mb"] == pytest.approx(3 * data["gradient_mb"])
    for s in ("tree", "leader"):
        assert schemes[s]["member_mb"] == pytest.approx(data["gradient_mb"])
    assert schemes["gloo"]["build_s"] > 0
    assert "÷ all" in capsys.readouterr().out
