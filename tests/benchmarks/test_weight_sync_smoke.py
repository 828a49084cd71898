"""Tiny-budget smoke run of benchmarks/weight_sync.py: both schemes deliver the sender's
weights to every engine and report seconds per GB."""

from __future__ import annotations

import importlib.util
import json
import pathlib

import pytest

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "weight_sync.py"


@pytest.mark.benchmark
@pytest.mark.ray
@pytest.mark.slow
def test_weight_sync_smoke(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("weight_sync_bench", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "out.json"
    mod.main(["--smoke", "--seed", "1", "--json", str(out)])
    data = json.loads(out.read_text())
    assert set(data["schemes"]) == {"object_store", "gloo_buckets"}
    assert all(r["s_per_gb"] > 0 for r in data["schemes"].values())
    assert "s/GB per engine" in capsys.readouterr().out


@pytest.mark.benchmark
@pytest.mark.ray
@pytest.mark.slow
def test_weight_sync_smoke_through_the_pool(tmp_path, capsys):
    """``--through pool``: the job's push through a real CellPool (learner → runners' engines),
    both schemes; the script itself checks the engines got the learner's weights bitwise."""
    spec = importlib.util.spec_from_file_location("weight_sync_bench", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "out.json"
    mod.main(["--smoke", "--through", "pool", "--engines", "1", "--seed", "1",   # 2 cells
              "--json", str(out)])
    data = json.loads(out.read_text())
    assert data["through"] == "pool" and set(data["schemes"]) == {"object_store", "broadcast"}
    assert all(r["s_per_gb"] > 0 for r in data["schemes"].values())
    assert data["first_broadcast_s"] > 0
    assert "through a CellPool" in capsys.readouterr().out
