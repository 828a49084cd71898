"""The shape of the cells on the cluster: :class:`CellLayout` (cells, bundles per cell, their
resources, the placement strategy) and :func:`check_layout`, which is pure: it validates a
layout against node resources before anything is created and names the numbers when it cannot
fit (``cells/pool.py`` creates the placement groups)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

STRATEGIES = ("STRICT_SPREAD", "PACK", "SPREAD", "STRICT_PACK")


class LayoutError(ValueError):
    """The cell layout cannot be placed on the cluster (the message names the numbers)."""


@dataclasses.dataclass(frozen=True, slots=True)
class CellLayout:
    """How cells map onto nodes."""

    cells: int
    """Number of cells."""
    nodes_per_cell: int = 1
    """Bundles (nodes) per cell."""
    gpus_per_node: int = 1
    """GPUs per bundle (logical GPUs on this machine)."""
    cpus_per_bundle: float = 1.0
    """CPUs per bundle (the runner and the learner take half each)."""
    strategy: str = "STRICT_SPREAD"
    """Placement strategy of a cell's bundles."""
    learner_resource: str = "CPU"
    """``CPU``, or a custom resource name the learner takes one unit of."""

    def __post_init__(self) -> None:
        for name in ("cells", "nodes_per_cell"):
            if getattr(self, name) < 1:
                raise ValueError(f"CellLayout.{name} must be >= 1, got {getattr(self, name)!r}")
        if self.gpus_per_node < 0 or not self.cpus_per_bundle > 0:
            raise ValueError(f"CellLayout.gpus_per_node must be >= 0 and cpus_per_bundle > 0, "
                             f"got {self.gpus_per_node!r}, {self.cpus_per_bundle!r}")
        if self.strategy not in STRATEGIES:
            raise ValueError(f"CellLayout.strategy must be one of {STRATEGIES}, "
                             f"got {self.strategy!r}")
        if self.learner_resource in ("GPU", ""):
            raise ValueError("CellLayout.learner_resource must be 'CPU' or a custom resource "
                             "(a learner asking for logical GPUs would try NCCL)")

    def bundle(self) -> dict[str, float]:
        """Resources of one bundle."""
        out = {"CPU": self.cpus_per_bundle}
        if self.gpus_per_node:
            out["GPU"] = float(self.gpus_per_node)
        if self.learner_resource != "CPU":
            out[self.learner_resource] = 1.0
        return out


def check_layout(layout: CellLayout, nodes: Sequence[Mapping[str, float]]) -> None:
    """Raise :class:`LayoutError` when ``layout`` cannot fit ``nodes`` (resource dicts).

    A node holds ``min over resources ⌊node[r] / bundle[r]⌋`` bundles; STRICT_SPREAD needs
    ``nodes_per_cell`` distinct nodes per cell.
    """
    need = layout.bundle()
    fits = [min(int(n.get(r, 0.0) // v) for r, v in need.items()) for n in nodes]
    total = layout.cells * layout.nodes_per_cell
    spread = layout.strategy == "STRICT_SPREAD"
    usable = sum(min(f, layout.cells) if spread else f for f in fits)
    hosts = sum(1 for f in fits if f > 0)
    if spread and hosts < layout.nodes_per_cell:
        raise LayoutError(
            f"CellLayout: STRICT_SPREAD cells of nodes_per_cell={layout.nodes_per_cell} need "
            f"that many nodes with a free bundle {need} (gpus_per_node={layout.gpus_per_node}),"
            f" the cluster has {hosts} of {len(nodes)}")
    if usable < total:
        raise LayoutError(
            f"CellLayout: {layout.cells} cells × nodes_per_cell={layout.nodes_per_cell} = "
            f"{total} bundles of {need} (gpus_per_node={layout.gpus_per_node}), the cluster's "
            f"{len(nodes)} nodes hold {usable}")
    if layout.strategy == "STRICT_PACK" and max(fits, default=0) < layout.nodes_per_cell:
        raise LayoutError(f"CellLayout: STRICT_PACK puts {layout.nodes_per_cell} bundles of "
                          f"{need} on one node; the largest node holds {max(fits, default=0)}")
