"""The mode registry: every mode name and the policy it builds, in one place.

The CLI, the benchmarks, the simulator, the cell-job config and the RLlib config all read
their mode names and policies from here::

    colocated              ColocatedPolicy()                   all cells switch together
    async                  AsyncPolicy(rollout_cells=r)        fixed pools
    elastic                ElasticPolicy()                     independent switches, streaming
    colocated+streaming    the streaming ablations of colocated / async
    async+streaming
    forecast               ForecastPolicy(per_h, horizon_h)    ours: needs the throughput and
                                                               run-timeout inputs

``CELL_MODES`` are the modes a job can name without forecast inputs (what ``CellJobConfig`` and
``XLongConfig.xlong(mode=...)`` accept).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from ray_xlong.scheduling.asynchronous import AsyncPolicy
from ray_xlong.scheduling.colocated import ColocatedPolicy
from ray_xlong.scheduling.elastic import ElasticPolicy
from ray_xlong.scheduling.forecast import ForecastPolicy
from ray_xlong.scheduling.policy import Policy

PAPER_MODES = ("colocated", "async", "elastic")
"""The paper's three systems."""
ABLATION_MODES = ("async+streaming", "colocated+streaming")
"""Streaming-only ablations of the baselines."""
CELL_MODES = PAPER_MODES + ("colocated+streaming", "async+streaming")
"""Modes that need no forecast inputs (what a job config may name)."""
ALL_MODES = CELL_MODES + ("forecast",)
"""Every registered mode."""


@dataclasses.dataclass(frozen=True, slots=True)
class ModeInputs:
    """What the policies of a mode may need besides the mode name."""

    async_rollout_cells: int = 1
    """Rollout pool of the async modes."""
    train_groups_per_cell_h: float | None = None
    """``forecast``: expected groups one training cell trains per hour (None: not known)."""
    horizon_h: float | None = None
    """``forecast``: the run timeout, in the clock's hours."""


def _forecast(i: ModeInputs) -> Policy:
    if i.train_groups_per_cell_h is None or i.horizon_h is None:
        raise ValueError("ModeInputs: mode 'forecast' needs train_groups_per_cell_h and "
                         "horizon_h")
    return ForecastPolicy(train_groups_per_cell_h=i.train_groups_per_cell_h,
                          horizon_h=i.horizon_h)


MODES: dict[str, Callable[[ModeInputs], Policy]] = {
    "colocated": lambda i: ColocatedPolicy(),
    "async": lambda i: AsyncPolicy(rollout_cells=i.async_rollout_cells),
    "elastic": lambda i: ElasticPolicy(),
    "colocated+streaming": lambda i: ColocatedPolicy(streaming=True,
                                                     name="colocated+streaming"),
    "async+streaming": lambda i: AsyncPolicy(rollout_cells=i.async_rollout_cells,
                                             streaming=True, name="async+streaming"),
    "forecast": _forecast,
}
"""Mode name → policy factory."""


def make_policy(mode: str, inputs: ModeInputs = ModeInputs()) -> Policy:
    """The policy of ``mode`` (a new object: policies keep state).

    Raises:
        ValueError: unknown mode (names the known ones), or missing forecast inputs.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {ALL_MODES}, got {mode!r}")
    return MODES[mode](inputs)
