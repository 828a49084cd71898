"""reduce_gradients: every scheme gives the sum of the parts in cell order (Ray tasks)."""

from __future__ import annotations

import pytest
import torch

from ray_xlong.cells.reduce import reduce_gradients, traffic_per_member

pytestmark = [pytest.mark.ray]


@pytest.fixture(scope="module")
def ray_small():
    import ray

    ray.init(num_cpus=1, object_store_memory=100 * 1024 ** 2, include_dashboard=False)
    yield ray
    ray.shutdown()


@pytest.mark.parametrize("scheme", ["all", "tree", "leader"])
@pytest.mark.parametrize("n", [1, 2, 5])
def test_every_scheme_sums_the_parts(ray_small, scheme, n):
    parts = [{"w": torch.full((3,), float(10 ** i)), "b": torch.tensor([float(i)])}
             for i in range(n)]                       # w sums to 1, 11, 11111 (readable)
    refs = [ray_small.put(p) for p in parts]
    out = reduce_gradients(refs, scheme=scheme)
    assert len(out) == (n if scheme == "all" or n == 1 else 1)
    got = [ray_small.get(r) if isinstance(r, ray_small.ObjectRef) else r for r in out]
    total = {k: sum(g[k] for g in got) for k in ("w", "b")}
    assert torch.equal(total["w"], torch.full((3,), float(sum(10 ** i for i in range(n)))))
    assert torch.equal(total["b"], torch.tensor([float(sum(range(n)))]))


def test_traffic_is_one_gradient_per_member_except_all():
    assert traffic_per_member(scheme="all", members=4, parts=4, nbytes=10)["member"] == 40
    assert traffic_per_member(scheme="tree", members=4, parts=4, nbytes=10) == \
        {"member": 10, "reducer": 20}
    assert traffic_per_member(scheme="leader", members=4, parts=4, nbytes=10) == \
        {"member": 10, "reducer": 40}


def test_bad_scheme_names_the_field():
    with pytest.raises(ValueError, match="reduce_gradients.scheme"):
        reduce_gradients([], scheme="ring")
