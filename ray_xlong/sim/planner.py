"""The planned policy: simulate candidate plans over the remaining work, follow the best.

A team does not know its best mode in advance (issue 28: colocated wins at 2 cells, forecast at
8, a fixed split at a staleness bound of 3), so :class:`PlannedPolicy` finds it while the job
runs:

```
events ──observe──► EventEstimator (run lengths: Kaplan-Meier of recent runs; training
                    cell-time per group; switch and sync costs — scheduling/estimates.py)
                    LiveJob (groups in flight with their versions, live runs with cell and start)
job start (with a prior) / step boundary, estimates moved (or every `replan_steps`) ──► plan:
    remaining job (steps left, same batch, bound, cells, slots), started from the live state:
    the cells' roles and switch ends, the groups in flight and ready, each live run finishing
    at a draw from the run-length distribution given its age; future runs drawn from it too
    for each candidate (colocated, elastic, forecast at several horizons, fixed splits):
        simulate(candidate, remaining job, start=live state)   ← the same simulator and
                                                                 settle loop as the job
    follow the candidate with the shortest predicted makespan (kept unless another is
    `hysteresis` better); its simulated step ends are the prediction the job is held to
no step in progress, the next step late: time since the plan > (1 + `divergence`) × the time
    predicted for it ──► plan again now, with the estimates of now (one that keeps the
    followed candidate leaves the step-boundary schedule as it was)
every decision ──► the followed candidate's decide(snapshot, event)
```

With a ``prior`` (estimates before the job's own events: a calibration job, the operator's
run-length distribution and cost model) the policy plans at job start; without one it runs as
``colocated`` until ``min_steps`` steps have ended (the one candidate that needs no estimate).
Changing plans never interrupts a live run: every candidate reads only the snapshot, the
planning simulation starts from the live state (so each candidate is charged the cost of taking
over from the plan followed so far), and the cell machine refuses any move that would leave a
cell with live runs.

Jobs with many slots are planned at a reduced scale (batch and slots ÷ ``k``, every ``k``-th
group in flight, each run's training work × ``k``: the same per-step rollout and training time)
so that a plan costs a bounded number of small simulations. Each plan is recorded
(:class:`PlanRecord`: time, predicted makespans, wall seconds on the driver).

State: the estimator, the live job, the followed plan and the plan log (build one per job).
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
from ray_xlong.scheduling.machine import CellMachine
from ray_xlong.scheduling.moves import Move
from ray_xlong.scheduling.policy import Policy
from ray_xlong.scheduling.state import ClusterState, SchedulingConfig
from ray_xlong.sim.cluster import ClusterConfig, CostConfig
from ray_xlong.sim.live import LiveJob
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
    reason: str = "due"
    """Why it was made: ``start`` (the prior, at job start), ``due`` (a step boundary with the
    estimates moved, or ``replan_steps`` since the last), ``late`` (the live job fell behind
    the followed plan's predicted step ends, :attr:`PlannedPolicy.divergence`)."""
    expected: tuple[float, ...] = ()
    """The followed candidate's predicted step ends (job time, log unit): the prediction the
    live job is held to."""


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
    wall_budget: float | None = None
    """Most share of the job's wall time the driver may spend re-planning (a plan pauses the
    driver between steps: on Ray a paper8 plan took 0.2–1 s of a ~25 s job); a plan falls due
    only while the plans so far stay within it. None: no limit (the simulator's jobs run in
    no wall time)."""


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
    divergence: float = 1.0
    """Re-plan, at any decision with no step in progress, when the live job falls behind the
    followed plan: the next step has not ended although the time since the plan is (1 +
    divergence) × the time the plan predicted for it (the estimates behind the plan no longer
    describe the job: runs grew longer than any seen). Relative to the whole predicted span,
    so that the phase of a bursty step rhythm does not count. 0: never (plan at step
    boundaries only)."""
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
    """The estimates of the last plan that set the step-boundary schedule (every plan but a
    late one that kept the followed candidate)."""
    basis_version: int = 0
    """Its version (``replan_steps`` count from it)."""
    seen_version: int = 0
    """Version of the last decision (a new one is a step boundary)."""
    prior: JobEstimates | None = None
    """Estimates before the job's own events (the operator's: a calibration, the cost model);
    with one the policy plans at job start instead of warming up as ``colocated``."""
    from_snapshot: bool = True
    """Plan the remaining job from the live state (runs in flight with their ages, the cells'
    roles); False: from an idle cluster."""
    live: LiveJob = field(default_factory=lambda: LiveJob())
    """The live part of the job (groups in flight, live runs), from the events."""
    started_wall: float | None = None
    """Driver clock (``perf_counter``) of the first decision."""
    spent_wall: float = 0.0
    """Driver seconds spent planning during the job (``PlanCosts.wall_budget``)."""

    def __post_init__(self) -> None:
        for name in ("min_steps", "replan_steps", "plan_batch"):
            if getattr(self, name) < 1:
                raise ValueError(f"PlannedPolicy.{name}: must be >= 1, got {getattr(self, name)}")

    def prepare(self, config: SchedulingConfig, slots) -> PlanRecord:
        """Plan the job from its prior before it starts (an idle cluster of ``slots`` per
        cell), so that the job's clock does not pay for the first plan."""
        if self.prior is None:
            raise ValueError("PlannedPolicy.prepare: needs a prior")
        idle = CellMachine(config, slots=list(slots)).snapshot(0.0)
        self.estimator.configure(config.batch_groups, config.runs_per_group)
        self.live.group_size = config.runs_per_group
        record = self.plan(idle, self.prior)
        self.spent_wall = 0.0  # not the job's time
        return record

    def decide(self, state: ClusterState, event: Event) -> tuple[Move, ...]:
        """Plan at job start (with the prior) and at a step boundary when due, then the
        followed candidate's moves."""
        if self.started_wall is None:
            self.started_wall = time.perf_counter()
        if self.estimator.group_size is None:
            self.estimator.configure(state.config.batch_groups, state.config.runs_per_group)
            self.live.group_size = state.config.runs_per_group
        boundary = state.step < 0 and not state.done
        if boundary and not self.plans and self.prior is not None:
            self.plan(state, self.prior, reason="start")
            self.seen_version = state.version
        elif boundary and state.version != self.seen_version:
            self.seen_version = state.version
            est = self._due(state)
            if est is not None:
                self.plan(state, est)
        elif boundary and self._late(state):
            est = self._due(state, late=True)
            if est is not None:
                self.plan(state, est, reason="late")
        return self.current.decide(state, event)

    def _late(self, state: ClusterState) -> bool:
        """The next step is late on the followed plan's prediction: the time since the plan
        exceeds the predicted time to that step by more than :attr:`divergence` (relative)."""
        if not self.divergence or not self.plans:
            return False
        last = self.plans[-1]
        k = state.version - last.version  # steps ended since the plan
        if k >= len(last.expected):
            return False
        return state.time - last.time > (1 + self.divergence) * (last.expected[k] - last.time)

    def _due(self, state: ClusterState, *, late: bool = False) -> JobEstimates | None:
        """The estimates to plan with now, or None (no plan due; ``late``: the live job
        departs from the plan, so a plan is due whenever the estimates and budget allow)."""
        est = self.estimator.estimates(state.time, state.config.batch_groups,
                                       min_steps=self.min_steps)
        if est is None:
            return None
        budget = self.costs.wall_budget
        if budget is not None and self.spent_wall >= budget * (
                time.perf_counter() - (self.started_wall or time.perf_counter())):
            return None
        if self.basis is None or not self.plans or late:
            return est
        due = est.moved(self.basis, self.tolerance) or \
            state.version - self.basis_version >= self.replan_steps
        return est if due else None

    def plan(self, state: ClusterState, est: JobEstimates | None = None, *,
             reason: str = "due") -> PlanRecord:
        """Simulate every candidate over the remaining work, from the live state; follow the
        best. ``est``: the estimates to plan with (default: the learned ones); ``reason``:
        recorded (:attr:`PlanRecord.reason`)."""
        t0 = time.perf_counter()
        if est is None:
            est = self.estimator.estimates(state.time, state.config.batch_groups, min_steps=1)
        if est is None:
            raise ValueError("PlannedPolicy.plan: no estimates yet and no prior")
        job, cluster, costs, workload, start = self._remaining(state, est)
        predicted: dict[str, float] = {}
        policies: dict[str, Policy] = {}
        ends: dict[str, tuple[float, ...]] = {}
        per_group = workload.group_tokens(0)  # planning units: cell-time a group of the job
        for label, make in candidates(est, per_group, cluster, job).items():
            policy = make(per_group)
            try:
                result = simulate(policy, workload=workload, cluster=cluster, costs=costs,
                                  config=job, start=start)
            except SimulationStalled:
                continue
            predicted[label], policies[label] = result.makespan_h, make(est.train_per_group)
            ends[label] = tuple(state.time + e.time for e in result.events
                                if e.kind == "step_ended")
        best = min(predicted, key=predicted.get, default=self.current_label)
        keep = best == self.current_label or (self.current_label in predicted and (
            predicted[self.current_label] <= predicted[best] * (1 + self.hysteresis)))
        if not keep or not self.plans:
            self.current, self.current_label = policies[best], best
        record = PlanRecord(time=state.time, version=state.version, predicted=predicted,
                            chosen=self.current_label, wall_s=time.perf_counter() - t0,
                            reason=reason, expected=ends.get(self.current_label, ()))
        self.spent_wall += record.wall_s
        self.plans.append(record)
        if reason != "late" or not keep:  # a late plan that confirms the followed one
            self.basis, self.basis_version = est, state.version  # leaves the schedule be
        return record

    def observe(self, events) -> None:
        """New events of the log (the settle loop calls this before every decision)."""
        self.estimator.observe(events)
        self.live.observe(events)

    def _remaining(self, state: ClusterState, est: JobEstimates):
        """The remaining job at planning scale, its workload and its start (the live state)."""
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
        q = sorted(est.duration_quantiles)
        durations = tuple(rng.choice(q) for _ in range(job.total_runs))
        start = self.live.start_state(state, q, every=k, max_groups=job.total_groups, rng=rng) \
            if self.from_snapshot else None
        return job, cluster, costs, Workload(durations, (per_run,) * job.total_runs,
                                             cfg.runs_per_group), start


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


def prior_estimates(durations, *, train_per_group: float, to_train: float = 0.0,
                    sync: float = 0.0, step_finish: float = 0.0,
                    quantiles: int = 200) -> JobEstimates:
    """Estimates before the job's own events: run durations from a sample (a calibration job,
    the operator's distribution), the costs of the cost model (log unit)."""
    d = sorted(durations)
    if not d or train_per_group <= 0:
        raise ValueError("prior_estimates: need durations and train_per_group > 0")
    q = tuple(d[min(len(d) - 1, int((k + 0.5) / quantiles * len(d)))] for k in range(quantiles))
    return JobEstimates(duration_quantiles=q, train_per_group=train_per_group,
                        to_train=to_train, sync=sync, step_finish=step_finish, horizon=d[-1],
                        runs_ended=0, steps_ended=0)


def planned_policy(*, costs: PlanCosts = PlanCosts(), **options) -> PlannedPolicy:
    """A new :class:`PlannedPolicy` (``options``: its fields)."""
    return PlannedPolicy(costs=costs, **options)


def with_costs(policy: PlannedPolicy, costs: PlanCosts) -> PlannedPolicy:
    """The same policy settings with other operator-given costs (a fresh state)."""
    return dataclasses.replace(policy, costs=costs, estimator=EventEstimator(),
                               current=ColocatedPolicy(), current_label="colocated", plans=[],
                               basis=None, basis_version=0, seen_version=0, live=LiveJob(), started_wall=None,
                               spent_wall=0.0)
