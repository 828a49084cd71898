"""Tiny-budget smoke runs of benchmarks/weight_sync.py (both schemes deliver the sender's
weights to every engine and report seconds per GB, between peers and through a real CellPool)
and of benchmarks/grad_reduce.py (every scheme sums the members' gradients).

The three runs share one Ray instance (each script starts its own only where none is up: two
``ray.init`` fewer)."""

from __future__ import annotations

import json
import pathlib

import pytest

from tests.shared import load_script

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "weight_sync.py"
GRAD_REDUCE = SCRIPT.parent / "grad_reduce.py"

pytestmark = [pytest.mark.benchmark, pytest.mark.ray, pytest.mark.slow]


@pytest.fixture(scope="module")
def ray_session():
    """One Ray instance sized as weight_sync's ``main`` sizes it for ``--through pool
    --engines 1`` (2 CPUs, a logical GPU per cell; the peers and grad_reduce's members take
    none; the object store holds grad_reduce's 600 MB too)."""
    import ray

    ray.init(num_cpus=2, num_gpus=2, object_store_memory=800 * 1024 ** 2,
             include_dashboard=False)
    try:
        yield
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def bench(ray_session):
    """benchmarks/weight_sync.py's module."""
    return load_script(SCRIPT, "weight_sync_bench")


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


def test_grad_reduce_smoke(tmp_path, capsys, ray_session):
    """benchmarks/grad_reduce.py: every scheme gives every member the same sum, and the
    object-store schemes other than ``all`` move one gradient into a member."""
    out = tmp_path / "out.json"
    bench = load_script(GRAD_REDUCE, "grad_reduce_bench")
    bench.main(["--smoke", "--seed", "1", "--json", str(out)])
    data = json.loads(out.read_text())
    schemes = data["schemes"]
    assert set(schemes) == {"all", "tree", "leader", "gloo"}
    assert schemes["all"]["member_mb"] == pytest.approx(3 * data["gradient_mb"])
    for s in ("tree", "leader"):
        assert schemes[s]["member_mb"] == pytest.approx(data["gradient_mb"])
    assert schemes["gloo"]["build_s"] > 0
    assert "÷ all" in capsys.readouterr().out
