"""Tiny-budget smoke run of benchmarks/weight_sync.py: both schemes deliver the sender's
weights to every engine and report seconds per GB, between peers and through a real CellPool.

Both runs share one Ray instance (the script starts its own only where none is up: one
``ray.init`` fewer)."""

from __future__ import annotations

import importlib.util
import json
import pathlib

import pytest

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "weight_sync.py"

pytestmark = [pytest.mark.benchmark, pytest.mark.ray, pytest.mark.slow]


@pytest.fixture(scope="module")
def bench():
    """The script's module, on one Ray instance sized as its ``main`` sizes it for ``--through
    pool --engines 1`` (2 CPUs, a logical GPU per cell; the peers take none)."""
    import ray

    spec = importlib.util.spec_from_file_location("weight_sync_bench", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    ray.init(num_cpus=2, num_gpus=2, object_store_memory=800 * 1024 ** 2,
             include_dashboard=False)
    try:
        yield mod
    finally:
        ray.shutdown()


def test_weight_sync_smoke(tmp_path, capsys, bench):
    out = tmp_path / "out.json"
    bench.main(["--smoke", "--seed", "1", "--json", str(out)])
    data = json.loads(out.read_text())
    assert set(data["schemes"]) == {"object_store", "gloo_buckets"}
    assert all(r["s_per_gb"] > 0 for r in data["schemes"].values())
    assert "s/GB per engine" in capsys.readouterr().out


def test_weight_sync_smoke_through_the_pool(tmp_path, capsys, bench):
    """``--through pool``: the job's push through a real CellPool (learner → runners' engines),
    both schemes; the script itself checks the engines got the learner's weights bitwise."""
    out = tmp_path / "out.json"
    bench.main(["--smoke", "--through", "pool", "--engines", "1", "--seed", "1",   # 2 cells
                "--json", str(out)])
    data = json.loads(out.read_text())
    assert data["through"] == "pool" and set(data["schemes"]) == {"object_store", "broadcast"}
    assert all(r["s_per_gb"] > 0 for r in data["schemes"].values())
    assert data["first_broadcast_s"] > 0
    assert "through a CellPool" in capsys.readouterr().out
