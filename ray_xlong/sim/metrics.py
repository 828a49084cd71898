"""Makespan lower bound and summary metrics of a simulation (DESIGN.md, performance model).

Lower bound = max(work bound, chain bound):

* work: (Σ run duration ÷ slots per cell  +  Σ trained tokens ÷ tokens per cell-hour) ÷ cells
  + steps × fixed step cost (the fixed cost is sequential and blocks the next update);
* chain: the longest run + the training of one group on every cell + the fixed cost of every
  step (some run must end before the last step can end; steps are applied one by one).

No schedule can beat either, so every mode's makespan is >= the bound (a property test).
"""

from __future__ import annotations

from dataclasses import dataclass

from ray_xlong.scheduling.state import SchedulingConfig
from ray_xlong.sim.cluster import ClusterConfig, CostConfig
from ray_xlong.sim.simulator import SimResult
from ray_xlong.sim.workload import Workload


def lower_bound_h(*, workload: Workload, cluster: ClusterConfig, costs: CostConfig,
                  config: SchedulingConfig) -> float:
    """Makespan no schedule can beat (see the module docstring), hours."""
    rollout = sum(workload.durations_h) / cluster.slots_per_cell
    training = sum(workload.tokens) / costs.train_tokens_per_cell_h
    fixed = config.total_steps * costs.step_fixed_h
    work = (rollout + training) / cluster.cells + fixed
    one_group = min(workload.group_tokens(g) for g in range(config.total_groups))
    chain = max(workload.durations_h) + one_group / costs.train_tokens_per_cell_h / cluster.cells
    return max(work, chain + fixed)


@dataclass(frozen=True, slots=True)
class ModeSummary:
    """One row of the benchmark table."""

    mode: str
    """Policy name."""
    makespan_h: float
    """Job time, hours."""
    gpu_idle_frac: float
    """Share of cell-time neither serving runs nor training."""
    staleness_mean: float
    """Mean staleness over groups."""
    staleness_max: int
    """Max staleness over groups."""
    steps: int
    """Steps trained."""
    runs: int
    """Runs trained."""


def summarize(result: SimResult) -> ModeSummary:
    """Table row of a simulation."""
    stale = result.staleness
    runs = sum(1 for e in result.events if e.kind == "run_ended")
    return ModeSummary(
        mode=result.mode, makespan_h=result.makespan_h, gpu_idle_frac=result.gpu_idle_frac,
        staleness_mean=sum(stale) / len(stale), staleness_max=max(stale),
        steps=len(set(result.trained_step)), runs=runs,
    )
