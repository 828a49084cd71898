"""The mode registry: every mode name and the policy it builds, in one place.

The CLI, the benchmarks, the simulator, the cell-job config and the RLlib config all read
their mode names and policies from here::

    colocated              ColocatedPolicy()                   all cells switch together
    async                  AsyncPolicy(rollout_cells=r)        fixed pools
    elastic                ElasticPolicy()                     independent switches, streaming
    colocated+streaming    the streaming ablations of colocated / async
    async+streaming
    forecast               ForecastPolicy(per_h, horizon_h)    ours; given no inputs (a real
                           or OnlineForecastPolicy()           job): learned from the job's
                                                               events, elastic until a step ended
    forecast_online        OnlineForecastPolicy()              the learned one by name (benchmarks)
    planned                PlannedPolicy()                     simulates candidate plans over the
                                                               remaining work, follows the best
                                                               (needs the simulator: ``planner``)
    best_static            AsyncPolicy(rollout_cells=r)        async with the split a simulator
                                                               found best (hindsight input r)

``CELL_MODES`` are the modes a job can name (what ``CellJobConfig``,
``XLongConfig.xlong(mode=...)``, ``ray_xlong.enable`` and ``ray-xlong train --mode`` accept):
``forecast`` there learns its inputs online, ``planned`` gets the simulator from
``cells.config.make_policy``.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from ray_xlong.scheduling.asynchronous import AsyncPolicy
from ray_xlong.scheduling.colocated import ColocatedPolicy
from ray_xlong.scheduling.elastic import ElasticPolicy
from ray_xlong.scheduling.forecast import ForecastPolicy
from ray_xlong.scheduling.online import OnlineForecastPolicy
from ray_xlong.scheduling.policy import Policy

PAPER_MODES = ("colocated", "async", "elastic")
"""The paper's three systems."""
ABLATION_MODES = ("async+streaming", "colocated+streaming")
"""Streaming-only ablations of the baselines."""
CELL_MODES = PAPER_MODES + ("colocated+streaming", "async+streaming", "forecast", "planned")
"""Modes a job config may name (no input a job cannot learn by itself)."""
ALL_MODES = CELL_MODES + ("forecast_online", "best_static")
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
    best_static_rollout_cells: int | None = None
    """``best_static``: the rollout pool of the best fixed split (found by simulating every
    split of the workload with hindsight: ``sim.modes.best_static_split``)."""
    planner: Callable[[], Policy] | None = None
    """``planned``: builds the planned policy (``ray_xlong.sim.planner.planned_policy``; the
    pure scheduling layer does not import the simulator)."""


def _forecast(i: ModeInputs) -> Policy:
    if i.train_groups_per_cell_h is None and i.horizon_h is None:
        return OnlineForecastPolicy(name="forecast")  # a real job: inputs learned online
    if i.train_groups_per_cell_h is None or i.horizon_h is None:
        raise ValueError("ModeInputs: mode 'forecast' needs both train_groups_per_cell_h and "
                         "horizon_h (or neither: learned online)")
    return ForecastPolicy(train_groups_per_cell_h=i.train_groups_per_cell_h,
                          horizon_h=i.horizon_h)


def _planned(i: ModeInputs) -> Policy:
    if i.planner is None:
        raise ValueError("ModeInputs.planner: mode 'planned' plans with the simulator; pass "
                         "ray_xlong.sim.planner.planned_policy (cells.config.make_policy does)")
    return i.planner()


def _best_static(i: ModeInputs) -> Policy:
    if i.best_static_rollout_cells is None:
        raise ValueError("ModeInputs: mode 'best_static' needs best_static_rollout_cells")
    return AsyncPolicy(rollout_cells=i.best_static_rollout_cells, name="best_static")


MODES: dict[str, Callable[[ModeInputs], Policy]] = {
    "colocated": lambda i: ColocatedPolicy(),
    "async": lambda i: AsyncPolicy(rollout_cells=i.async_rollout_cells),
    "elastic": lambda i: ElasticPolicy(),
    "colocated+streaming": lambda i: ColocatedPolicy(streaming=True,
                                                     name="colocated+streaming"),
    "async+streaming": lambda i: AsyncPolicy(rollout_cells=i.async_rollout_cells,
                                             streaming=True, name="async+streaming"),
    "forecast": _forecast,
    "forecast_online": lambda i: OnlineForecastPolicy(),
    "planned": _planned,
    "best_static": _best_static,
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
