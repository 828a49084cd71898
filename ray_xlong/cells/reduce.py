"""Reducing the cells' gradients of a step without every member fetching every gradient.

The elastic step's members change every step, so a collective group would have to be rebuilt
at each membership change; instead the sum is a fixed shape of small Ray tasks over the object
store, in cell order (measured in ``benchmarks/grad_reduce.py``; ``leader`` was the cheapest of
the three on one node, the tree is there for many cells on many nodes)::

    scheme "all"  (issue 5)   every member fetches g_0 … g_{n-1}, sums      n·P in per member
    scheme "tree"             ((g_0 + g_1) + (g_2 + g_3)) …  by _add tasks  P in per member,
                              fan_in·P in per tree task; ⌈log_fan_in n⌉ levels
    scheme "leader" (default) one _add task over all n                        P in per member,
                                                                              n·P in the leader

(P: bytes of one gradient.) The tree's shape depends only on the number of parts, so every
member applies the bit-identical sum; only the order of additions differs from "all" (float
rounding, docs/design.md invariant 7 holds to tolerance). A member that died before its gradient
was taken makes the sum's ref fail with its actor error, as a direct fetch would.
``benchmarks/grad_reduce.py`` measures the three side by side (and a gloo process group built
per membership, the alternative the issue names).
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import ray
import torch

SCHEMES = ("all", "tree", "leader")
"""``reduce_gradients`` schemes."""


@ray.remote(num_cpus=0)
def _add(*parts: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``Σ parts`` by name, added left to right."""
    out = {name: t.clone() for name, t in parts[0].items()}
    for part in parts[1:]:
        for name, t in part.items():
            out[name] += t
    return out


def reduce_gradients(parts: Sequence[Any], *, scheme: str = "leader",
                     fan_in: int = 2) -> list[Any]:
    """The ``apply_step`` argument for ``parts`` (gradient dicts or refs, in cell order).

    Args:
        parts: the members' ``take_gradients`` refs (and banked gradients), in order.
        scheme: one of :data:`SCHEMES`.
        fan_in: parts summed by one tree task (``tree``; >= 2).

    Returns:
        ``list(parts)`` for ``all`` (each member sums them), else ``[ref of the sum]``.
    """
    if scheme not in SCHEMES:
        raise ValueError(f"reduce_gradients.scheme must be one of {SCHEMES}, got {scheme!r}")
    if fan_in < 2:
        raise ValueError(f"reduce_gradients.fan_in must be >= 2, got {fan_in!r}")
    if scheme == "all" or len(parts) <= 1:
        return list(parts)
    if scheme == "leader":
        return [_add.remote(*parts)]
    level = list(parts)
    while len(level) > 1:
        level = [_add.remote(*level[i:i + fan_in]) if len(level[i:i + fan_in]) > 1
                 else level[i] for i in range(0, len(level), fan_in)]
    return level


def traffic_per_member(*, scheme: str, members: int, parts: int, nbytes: int,
                       fan_in: int = 2) -> dict[str, int]:
    """Bytes fetched per member and by the busiest reducer task for one step (analytic).

    Returns:
        ``{"member": bytes into each member, "reducer": bytes into the busiest _add task}``.
    """
    if scheme == "all":
        return {"member": parts * nbytes, "reducer": 0}
    if parts <= 1:
        return {"member": nbytes, "reducer": 0}
    reducer = parts if scheme == "leader" else min(fan_in, parts)
    return {"member": nbytes, "reducer": reducer * nbytes}
