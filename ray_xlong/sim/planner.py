"""The planned policy: simulate candidate plans over the remaining work, follow the best.

A team does not know its best mode in advance (issue 28: colocated wins at 2 cells, forecast at
8, a fixed split at a staleness bound of 3), so :class:`PlannedPolicy` finds it while the job
runs:

```
events ──observe──► EventEstimator (run lengths: Kaplan-Meier of recent runs; training
                    cell-time per group; switch and sync costs — scheduling/estimates.py)
step boundary, estimates moved (or every `replan_steps`) ──► plan:
    remaining job (steps left, same batch, bound, cells, slots), a workload drawn from the
    estimated run-length distribution, the learned costs
    for each candidate (colocated, elastic, forecast at several horizons, fixed splits):
        simulate(candidate, remaining job)   ← the same simulator and settle loop as the job
    follow the candidate with the shortest predicted makespan (kept unless another is
    `hysteresis` better)
every decision ──► the followed candidate's decide(snapshot, event)
```

Until ``min_steps`` steps have ended there is nothing to plan with, and the policy runs as
``colocated`` (the one candidate that needs no estimate; where it is the best plan, small
clusters, the warm-up then costs nothing: with an elastic warm-up, paper-2.4t-shift at 2 cells
came out 2.1% over colocated, with this one equal to it). Changing plans never interrupts a live run: every candidate reads only the
snapshot, and the cell machine refuses any move that would leave a cell with live runs.

The planning simulation starts the remaining job from an idle cluster (the snapshot's runs in
flight are not carried over), and jobs with many slots are planned at a reduced scale
(batch and slots ÷ ``k``, each run's training work × ``k``: the same per-step rollout and
training time) so that a plan costs a bounded number of small simulations. Each plan is
recorded (:class:`PlanRecord`: time, predicted makespans, wall seconds on the driver).

State: the estimator, the followed plan and the plan log (build one per job).
"""

from __future__ import annotations

import dataclasses
import random
import time
from dataclasses import dataclass, field
from typing import Callable

from ray_xlong.scheduling.asynchronous import AsyncPolicy
from ray_xlong.scheduling.colocated import ColocatedPolicy
from ray_xlong.scheduling.elastic import ElasticPolicy
from ray_xlong.scheduling.estimates import EventEstimator, JobEstimates
from ray_xlong.scheduling.events import Event
from ray_xlong.scheduling.forecast import ForecastPolicy
from ray_xlong.scheduling.moves import Move
from ray_xlong.scheduling.policy import Policy
from ray_xlong.scheduling.state import ClusterState, SchedulingConfig
from ray_xlong.sim.cluster import ClusterConfig, CostConfig
from ray_xlong.sim.simulator import SimulationStalled, simulate
from ray_xlong.sim.workload import Workload

HORIZONS = (0.5, 1.0)
"""Forecast candidates: the learned horizon times these factors."""


@dataclass(frozen=True, slots=True)
class PlanRecord:
    """One planning: when, what each candidate was predicted to take, what was chosen."""

    time: float
    """Job time of the plan (log unit)."""
    version: int
    """Policy version (steps applied) at the plan."""
    predicted: dict
    """Candidate label → predicted makespan of the remaining work (log unit)."""
    chosen: str
    """The candidate followed from now on."""
    wall_s: float
    """Driver wall seconds the plan took (every candidate's simulation)."""


@dataclass(frozen=True, slots=True)
class PlanCosts:
    """What the estimator cannot see, given by the operator (defaults: nothing)."""

    step_fixed: float = 0.0
    """Per-step fixed cost, log unit; 0: the estimator's ``step_finish`` (learned where the log
    has micro-batch events, else counted in the training cell-time)."""
    finish_blocks: bool = False
    """The step finish blocks the actuator (the Ray driver: True)."""
    parallel_training_cells: float = float("inf")
    """Cells training at full speed at once (``CostConfig``)."""


@dataclass(slots=True)
class PlannedPolicy:
    """Plans with the simulator, follows the best candidate (see the module docstring)."""

    min_steps: int = 1
    """Steps seen before the first plan (the warm-up, ``colocated``, until then)."""
    replan_steps: int = 12
    """Re-plan at least this often (steps), even if the estimates stayed put."""
    tolerance: float = 0.15
    """Re-plan at a step boundary when the mean run length or training cost moved this much."""
    hysteresis: float = 0.01
    """Leave the followed plan only for one predicted this much faster."""
    plan_batch: int = 8
    """Plan at a reduced scale: at least this many groups a step (and 16 slots a cell)."""
    costs: PlanCosts = PlanCosts()
    """Costs the events do not show."""
    seed: int = 0
    """Seed of the planning workload (drawn from the estimates)."""
    name: str = "planned"
    """Mode name in tables and logs."""
    estimator: EventEstimator = field(default_factory=EventEstimator)
    """What the job's events say so far."""
    current: Policy = field(default_factory=ColocatedPolicy)
    """The candidate followed now; at the start, the warm-up: colocated, the one plan that
    needs no estimate (and, where it is the best plan, a warm-up that costs nothing)."""
    current_label: str = "colocated"
    """Its label."""
    plans: list[PlanRecord] = field(default_factory=list)
    """Every plan made."""
    basis: JobEstimates | None = None
    """The estimates of the last plan."""
    seen_version: int = 0
    """Version of the last decision (a new one is a step boundary)."""

    def __post_init__(self) -> None:
        for name in ("min_steps", "replan_steps", "plan_batch"):
            if getattr(self, name) < 1:
                raise ValueError(f"PlannedPolicy.{name}: must be >= 1, got {getattr(self, name)}")

    def observe(self, events) -> None:
        """New events of the log (the settle loop calls this before every decision)."""
        self.estimator.observe(events)

    def decide(self, state: ClusterState, event: Event) -> tuple[Move, ...]:
        """Re-plan at a step boundary when due, then the followed candidate's moves."""
        if self.estimator.group_size is None:
            self.estimator.configure(state.config.batch_groups, state.config.runs_per_group)
        if state.version != self.seen_version:
            self.seen_version = state.version
            if not state.done and self._due(state):
                self.plan(state)
        return self.current.decide(state, event)

    def _due(self, state: ClusterState) -> bool:
        est = self.estimator.estimates(state.time, state.config.batch_groups,
                                       min_steps=self.min_steps)
        if est is None:
            return False
        if self.basis is None or not self.plans:
            return True
        return est.moved(self.basis, self.tolerance) or \
            state.version - self.plans[-1].version >= self.replan_steps

    def plan(self, state: ClusterState) -> PlanRecord:
        """Simulate every candidate over the remaining work; follow the best."""
        t0 = time.perf_counter()
        est = self.estimator.estimates(state.time, state.config.batch_groups, min_steps=1)
        assert est is not None  # _due checked
        job, cluster, costs, workload = self._remaining(state, est)
        predicted: dict[str, float] = {}
        policies: dict[str, Policy] = {}
        per_group = workload.group_tokens(0)  # planning units: cell-time a group of the job
        for label, make in candidates(est, per_group, cluster, job).items():
            policy = make(per_group)
            try:
                result = simulate(policy, workload=workload, cluster=cluster, costs=costs,
                                  config=job)
            except SimulationStalled:
                continue
            predicted[label], policies[label] = result.makespan_h, make(est.train_per_group)
        best = min(predicted, key=predicted.get, default=self.current_label)
        keep = best == self.current_label or (self.current_label in predicted and (
            predicted[self.current_label] <= predicted[best] * (1 + self.hysteresis)))
        if not keep:
            self.current, self.current_label = policies[best], best
        record = PlanRecord(time=state.time, version=state.version, predicted=predicted,
                            chosen=self.current_label, wall_s=time.perf_counter() - t0)
        self.plans.append(record)
        self.basis = est
        return record

    def _remaining(self, state: ClusterState, est: JobEstimates):
        cfg = state.config
        slots = min(c.slots for c in state.cells)
        k = max(1, min(cfg.batch_groups // self.plan_batch, slots // 16))
        batch = max(1, cfg.batch_groups // k)
        work_scale = cfg.batch_groups / batch  # each run trains for k runs' worth
        job = SchedulingConfig(total_steps=cfg.total_steps - state.version, batch_groups=batch,
                               runs_per_group=cfg.runs_per_group,
                               staleness_bound=cfg.staleness_bound)
        cluster = ClusterConfig(cells=len(state.cells), nodes_per_cell=1, gpus_per_node=1,
                                slots_per_cell=max(1, round(slots / work_scale)))
        per_run = est.train_per_group * work_scale / cfg.runs_per_group
        costs = CostConfig(train_tokens_per_cell_h=1.0,
                           step_fixed_h=self.costs.step_fixed or est.step_finish,
                           to_train_h=est.to_train, sync_h=est.sync,
                           parallel_training_cells=self.costs.parallel_training_cells,
                           finish_blocks=self.costs.finish_blocks)
        rng = random.Random(self.seed + state.version)
        q = est.duration_quantiles
        durations = tuple(rng.choice(q) for _ in range(job.total_runs))
        return job, cluster, costs, Workload(durations, (per_run,) * job.total_runs,
                                             cfg.runs_per_group)


def candidates(est: JobEstimates, per_group: float, cluster: ClusterConfig,
               job: SchedulingConfig) -> dict[str, Callable[[float], Policy]]:
    """The plans a planning compares: colocated, elastic, forecast at :data:`HORIZONS` × the
    learned horizon, and fixed splits (every split up to 8 cells; else five spread over the
    range plus the three splits around the one whose rollout ÷ training capacity matches the
    estimated work).
    ``per_group``: training cell-time of one group of ``job`` (the planning scale); each
    factory takes the cell-time of a group at the scale it will run at (planning or job)."""
    cells = cluster.cells
    out: dict[str, Callable[[float], Policy]] = {
        "colocated": lambda g: ColocatedPolicy(), "elastic": lambda g: ElasticPolicy(),
    }
    for f in HORIZONS:
        h = max(est.horizon * f, 1e-9)
        out[f"forecast(h×{f:g})"] = lambda g, h=h: ForecastPolicy(
            train_groups_per_cell_h=1.0 / g, horizon_h=h)
    for r in splits(est, per_group, cluster, job):
        out[f"split({r}/{cells - r})"] = lambda g, r=r: AsyncPolicy(rollout_cells=r)
    return out


def splits(est: JobEstimates, per_group: float, cluster: ClusterConfig,
           job: SchedulingConfig) -> list[int]:
    """Rollout-pool sizes to try (see :func:`candidates`)."""
    cells, slots = cluster.cells, cluster.slots_per_cell
    if cells < 2:
        return []
    if cells <= 8:
        return list(range(1, cells))
    rollout = est.mean_duration * job.batch_groups * job.runs_per_group / slots
    training = per_group * job.batch_groups
    matched = round(cells * rollout / (rollout + training))
    spread = {max(1, min(cells - 1, round(cells * i / 6))) for i in range(1, 6)}
    near = {max(1, min(cells - 1, matched + d)) for d in (-1, 0, 1)}
    return sorted(spread | near)


def planned_policy(*, costs: PlanCosts = PlanCosts(), **options) -> PlannedPolicy:
    """A new :class:`PlannedPolicy` (``options``: its fields)."""
    return PlannedPolicy(costs=costs, **options)


def with_costs(policy: PlannedPolicy, costs: PlanCosts) -> PlannedPolicy:
    """The same policy settings with other operator-given costs (a fresh state)."""
    return dataclasses.replace(policy, costs=costs, estimator=EventEstimator(),
                               current=ColocatedPolicy(), current_label="colocated", plans=[],
                               basis=None, seen_version=0)
