"""Makespan lower bound and summary metrics of a simulation (DESIGN.md, performance model).

Lower bound = max(work bound, chain bound, admission bound):

* work: (Σ run duration ÷ slots per cell  +  Σ trained tokens ÷ tokens per cell-hour
  + steps × fixed step cost) ÷ cells. The fixed cost occupies at least one cell per step; it
  does not stop the other cells (elastic / async cells keep rolling out meanwhile), so it is
  cell-time, not wall time;
* chain: the longest run, then the training of that run's group (at best on every cell), then
  one fixed step cost (the step holding that group cannot end earlier); and the fixed costs of
  all steps, which are applied one by one after the first group ended;
* admission (the staleness bound): while the version is ``v`` at most ``(v + b + 1) × B``
  groups may have started and ``v × B`` are trained, so at most ``(b + 1) × B`` groups have a
  live run at any time; each has one for at least its longest run. So
  Σ_groups longest run ≤ (b + 1) × B × makespan, whatever the cluster size. It binds on big
  clusters and tight bounds (paper-2.4t seed 0: 35.95 h at b = 7, above the work bound of
  32.42 h at 16 cells and 16.21 h at 32), where adding cells cannot help.

No schedule can beat either, so every mode's makespan is >= the bound (a property test).

:func:`role_switches` counts each cell's role switches in an event log (the main job's summary).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from ray_xlong.scheduling.events import Event
from ray_xlong.scheduling.state import SchedulingConfig
from ray_xlong.sim.cluster import ClusterConfig, CostConfig
from ray_xlong.sim.simulator import SimResult
from ray_xlong.sim.workload import Workload


def lower_bound_h(*, workload: Workload, cluster: ClusterConfig, costs: CostConfig,
                  config: SchedulingConfig) -> float:
    """Makespan no schedule can beat (see the module docstring), hours."""
    return max(bound_parts(workload=workload, cluster=cluster, costs=costs,
                           config=config).values())


def bound_parts(*, workload: Workload, cluster: ClusterConfig, costs: CostConfig,
                config: SchedulingConfig) -> dict[str, float]:
    """The parts of :func:`lower_bound_h`: ``work``, ``chain`` and ``admission`` (hours)."""
    rollout = sum(workload.durations_h) / cluster.slots_per_cell
    training = sum(workload.tokens) / costs.train_tokens_per_cell_h
    fixed = config.total_steps * costs.step_fixed_h
    work = (rollout + training + fixed) / cluster.cells
    g = config.runs_per_group
    ends = [max(workload.durations_h[k * g:(k + 1) * g]) for k in range(config.total_groups)]
    last = max(range(config.total_groups), key=lambda k: ends[k])
    per_h = costs.train_tokens_per_cell_h * cluster.cells
    chain_last = ends[last] + workload.group_tokens(last) / per_h
    chain_steps = min(ends) + fixed
    in_flight = (config.staleness_bound + 1) * config.batch_groups
    return {"work": work, "chain": max(chain_last + costs.step_fixed_h, chain_steps),
            "admission": sum(ends) / in_flight}


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


SWITCH_ROLES = ("training", "syncing")
"""A cell switches role when it enters training (from rollout, directly or after draining) or
starts syncing back to rollout; ``draining`` and the ``rollout`` after a sync are the two
halves of those switches, not switches of their own."""


def role_switches(events: Sequence[Event]) -> dict[int, int]:
    """Role switches per cell of an event log (simulated or from Ray: the same format).

    Returns:
        ``{cell: switches}`` for every cell that appears in ``events`` (0 when it never switched).
    """
    out = {e.cell: 0 for e in events if e.cell >= 0}
    for e in events:
        if e.kind == "role" and e.role in SWITCH_ROLES:
            out[e.cell] += 1
    return dict(sorted(out.items()))


def window_parts(result: SimResult, config: SchedulingConfig) -> dict[str, float]:
    """Where a run's makespan goes against the staleness admission bound (hours).

    A group holds one of the ``(b + 1) × B`` places of the admission window from its first
    run's start until the step that trains it has ended (the version then moves on and admits
    a new group). So ``makespan = Σ hold ÷ ((b + 1) × B) + (time the window was not full)``,
    and the admission bound is the first term with every hold cut to the group's longest run.

    Returns (means over groups, except the totals):
        ``longest_h`` (the group's longest run), ``stagger_h`` (its first start → last end,
        beyond the longest run: runs started apart), ``ready_h`` (last run ended → taken by
        a step, the step then in progress or the next), ``step_h`` (taken → the step ended:
        training, the finish), ``full_window_h`` (Σ hold ÷ window), ``not_full_h``
        (makespan − that: admission not the limit, e.g. the job's last groups ending).
    """
    g_size = config.runs_per_group
    first: dict[int, float] = {}
    last: dict[int, float] = {}
    began: dict[int, float] = {}
    longest: dict[int, float] = {}
    step_end: dict[int, float] = {}
    taken: dict[int, float] = {}  # step -> when it started (groups are taken from then on)
    for e in result.events:
        if e.kind == "run_started":
            began[e.run] = e.time
            first.setdefault(e.run // g_size, e.time)
        elif e.kind == "run_ended":
            g = e.run // g_size
            last[g] = e.time
            longest[g] = max(longest.get(g, 0.0), e.time - began.get(e.run, e.time))
        elif e.kind == "step_ended":
            step_end[e.step] = e.time
        elif e.kind == "step_started":
            taken[e.step] = e.time
    groups = range(len(result.trained_step))
    n = len(result.trained_step)
    hold = [step_end[result.trained_step[g]] - first[g] for g in groups]
    window = (config.staleness_bound + 1) * config.batch_groups
    took = [max(last[g], taken[result.trained_step[g]]) for g in groups]
    return {
        "longest_h": sum(longest.values()) / n,
        "stagger_h": sum(last[g] - first[g] - longest[g] for g in groups) / n,
        "ready_h": sum(took[g] - last[g] for g in groups) / n,
        "step_h": sum(step_end[result.trained_step[g]] - took[g] for g in groups) / n,
        "full_window_h": sum(hold) / window,
        "not_full_h": result.makespan_h - sum(hold) / window,
    }
