"""Discrete-event simulator: the actuator that applies a policy's moves to a virtual clock.

```
heap of (time, seq, what) ──pop──► report to CellMachine ──► policy.decide(snapshot, event)
        ▲                                                          │ moves
        └── run ends, switch/sync ends, step work exhausted ◄── apply (validated by machine)
```

Training is a fluid: the step in progress holds the cell-hours of the groups it took; the
cells on it (after their switch) work it down at one cell-hour per hour each; when all taken
work is done and the step holds B groups, each cell on it logs its last ``micro_batch``, the
fixed per-step cost follows and the step ends.
With ``CostConfig.finish_blocks`` that fixed cost blocks the actuator, as it blocks the Ray
driver: events falling inside it are handled when it ends (runs that ended meanwhile free
their slots, and new runs start, only then).

A simulation may start from a job already under way (:class:`StartState`: the planner's
picture of a live cluster): groups in flight with their versions, live runs with the time each
has left, cells' roles and the ends of their switches.

Invariants: the policy is called with the state *after* each event, and again at the same
instant until it returns no moves (at most ``MAX_ROUNDS`` + 4 per cell); the run is deterministic for a
(workload, policy, configs) tuple; a stall (nothing scheduled, job not done) raises.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

from ray_xlong.scheduling.events import Event
from ray_xlong.scheduling.machine import CellMachine
from ray_xlong.scheduling.moves import JoinStep, Reserve, StartTraining, Sync
from ray_xlong.scheduling.policy import Policy
from ray_xlong.scheduling.state import Role, SchedulingConfig
from ray_xlong.sim.cluster import ClusterConfig, CostConfig
from ray_xlong.sim.workload import Workload

MAX_ROUNDS = 16
EPS = 1e-9


class SimulationStalled(RuntimeError):
    """Nothing is scheduled but the job is not done (the policy waits for nothing)."""


@dataclass(frozen=True, slots=True)
class StartState:
    """A job under way at a step boundary (no step in progress), time 0 = now, version 0 = the
    live version. Groups are the job's first groups (run ids ``g * G ..``); only the last may
    have unstarted runs."""

    groups: tuple[tuple[int, int, int], ...]
    """Per group, in start order: ``(version, runs ended, runs not started)`` (version <= 0:
    how many steps before the live version its first run started)."""
    live: tuple[tuple[int, int, float, float], ...]
    """Live runs: ``(group, cell, start (<= 0), time left)``."""
    roles: tuple[Role, ...]
    """Each cell's role (training cells idle: no step is in progress)."""
    ready_at: tuple[float, ...]
    """When each cell's switch or sync ends (<= 0: ready)."""


@dataclass(frozen=True, slots=True)
class SimResult:
    """Outcome of one simulation."""

    mode: str
    """Policy name."""
    makespan_h: float
    """Time the last step ended."""
    busy_cell_h: float
    """Cell-hours spent serving runs (live / slots) or training (incl. fixed step cost)."""
    cells: int
    """Cells in the cluster."""
    staleness: tuple[int, ...]
    """Per group: step that trained it - its version."""
    trained_step: tuple[int, ...]
    """Per group: the step that trained it."""
    events: tuple[Event, ...]
    """The full event log."""

    @property
    def gpu_idle_frac(self) -> float:
        """1 - busy cell-time / (cells × makespan)."""
        return 1.0 - self.busy_cell_h / (self.cells * self.makespan_h)


class _Sim:
    def __init__(self, policy: Policy, workload: Workload, cluster: ClusterConfig,
                 costs: CostConfig, config: SchedulingConfig,
                 start: StartState | None = None) -> None:
        if len(workload.durations_h) != config.total_runs:
            raise ValueError(
                f"simulate.workload: {len(workload.durations_h)} runs, job needs {config.total_runs}"
            )
        self.policy, self.w, self.costs = policy, workload, costs
        self.m = CellMachine(config, slots=[cluster.slots_per_cell] * cluster.cells)
        self.heap: list[tuple[float, int, str, int, int]] = []
        self.seq = 0
        self.now = 0.0
        self.work_left = 0.0  # cell-hours of taken work not yet trained
        self.gen = 0  # invalidates stale "exhausted" events
        self.finishing = False
        self.blocked_until = -1.0  # costs.finish_blocks: the driver is busy ending a step
        self.busy = 0.0
        if start is not None:
            self._resume(start)

    def _resume(self, start: StartState) -> None:
        """Put the machine in ``start``'s state (see :class:`StartState`)."""
        m, led, g_size = self.m, self.m.ledger, self.m.config.runs_per_group
        if len(start.groups) > led.config.total_groups or len(start.roles) != len(m.slots):
            raise ValueError(f"StartState: {len(start.groups)} groups / {len(start.roles)} "
                             f"cells for a job of {led.config.total_groups} / {len(m.slots)}")
        live_of: dict[int, list] = {}
        for g, cell, began, left in start.live:
            live_of.setdefault(g, []).append((began, cell, left))
        for g, (version, ended, unstarted) in enumerate(start.groups):
            live = sorted(live_of.get(g, ()))
            if g < len(start.groups) - 1:
                unstarted = 0  # only the last group may be partly started
            ended = g_size - unstarted - len(live)
            if ended < 0:
                raise ValueError(f"StartState: group {g} has {len(live)} live runs, "
                                 f"{unstarted} not started, group size {g_size}")
            led.resume_group(g, version, ended)
            for j, (began, cell, left) in enumerate(live):
                run = g * g_size + ended + j
                m.live[cell][run] = began
                m.run_cell[run] = cell
                self.push(max(0.0, left), "run_end", cell, run)
            led.next_run = g * g_size + g_size - unstarted
        for cell, (role, ready) in enumerate(zip(start.roles, start.ready_at)):
            m.role[cell] = role
            if ready > 0:
                self.delay(cell, ready)
        for cell in range(len(m.slots)):  # a live dict is oldest first
            m.live[cell] = dict(sorted(m.live[cell].items(), key=lambda kv: kv[1]))

    def push(self, t: float, what: str, a: int = -1, b: int = -1) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, self.seq, what, a, b))

    def rate(self) -> float:
        """Cell-hours of training done per hour: the ready cells on the step (at most
        ``parallel_training_cells`` of them at full speed)."""
        m = self.m
        n = sum(1 for c, s in enumerate(m.step_of) if s >= 0 and m.ready_at[c] <= self.now + EPS)
        return min(n, self.costs.parallel_training_cells)

    def busy_frac_sum(self) -> float:
        m, total = self.m, 0.0
        for c, role in enumerate(m.role):
            if role in (Role.ROLLOUT, Role.DRAINING):
                total += len(m.live[c]) / m.slots[c]
            elif m.step_of[c] >= 0 and m.ready_at[c] <= self.now + EPS:
                total += 1.0 if (self.work_left > EPS or self.finishing) else 0.0
        return total

    def advance(self, t: float) -> None:
        dt = t - self.now
        if dt > 0:
            self.busy += dt * self.busy_frac_sum()
            if not self.finishing:
                self.work_left = max(0.0, self.work_left - dt * self.rate())
        self.now = t

    def handle(self, what: str, a: int, b: int) -> None:
        m = self.m
        if what == "run_end":
            m.run_ended(a, b, self.now)
        elif what == "ready":
            if abs(m.ready_at[a] - self.now) > EPS:
                return  # superseded: a later switch / sync on this cell moved its ready time
            m.cell_ready(a, self.now)
        elif what == "step_end":
            self.finishing = False
            m.end_step(self.now)
        elif what == "exhausted" and a != self.gen:
            return

    def act(self) -> None:
        def apply(move, runs: list[int], was_training: bool) -> None:
            for run in runs:
                self.push(self.now + self.w.durations_h[run], "run_end", move.cell, run)
            if isinstance(move, (Reserve, StartTraining, JoinStep)) and not was_training:
                self.delay(move.cell, self.costs.to_train_h)
            elif isinstance(move, Sync):
                self.delay(move.cell, self.costs.sync_h)

        self.m.settle(self.policy, lambda: self.now, apply=apply, after_round=self.train,
                      max_rounds=MAX_ROUNDS + 4 * len(self.m.slots))

    def delay(self, cell: int, hours: float) -> None:
        self.m.busy_until(cell, self.now + hours)
        self.push(self.now + hours, "ready", cell)

    def train(self) -> None:
        m = self.m
        per_h = self.costs.train_tokens_per_cell_h
        for group in m.take_groups():
            self.work_left += self.w.group_tokens(group) / per_h
        if m.step < 0 or self.finishing:
            return
        self.gen += 1
        if self.work_left <= EPS:
            if m.step_groups == m.config.batch_groups:
                for c, s in enumerate(m.step_of):  # every cell on the step ends its last one
                    if s >= 0 and m.ready_at[c] <= self.now + EPS:
                        m.micro_batch_done(c, self.now)
                self.finishing = True
                self.push(self.now + self.costs.step_fixed_h, "step_end")
                if self.costs.finish_blocks:
                    self.blocked_until = self.now + self.costs.step_fixed_h
            else:
                m.set_starved(True, self.now)
        else:
            m.set_starved(False, self.now)
            r = self.rate()
            if r:
                self.push(self.now + self.work_left / r, "exhausted", self.gen)

    def run(self) -> SimResult:
        self.act()
        while not self.m.done:
            if not self.heap:
                raise SimulationStalled(f"{self.policy.name}: stalled at {self.now:.3f} h: "
                                        f"{self.m.snapshot(self.now)}")
            t, _, what, a, b = heapq.heappop(self.heap)
            if t < self.blocked_until - EPS and what != "step_end":
                self.defer(t, what, a, b)
                continue
            self.advance(t)
            self.handle(what, a, b)
            self.train()
            self.act()
        return self.result()

    def defer(self, t: float, what: str, a: int, b: int) -> None:
        """An event during a blocking step finish: seen when the finish ends (a switch or sync
        that ended meanwhile makes its cell ready then, as the Ray driver logs it)."""
        if what == "ready":
            if abs(self.m.ready_at[a] - t) > EPS:
                return  # superseded anyway
            self.m.busy_until(a, self.blocked_until)
        self.push(self.blocked_until, what, a, b)

    def result(self) -> SimResult:
        led = self.m.ledger
        stale = tuple(s - v for s, v in zip(led.trained_step, led.group_version))
        return SimResult(
            mode=self.policy.name, makespan_h=self.now, busy_cell_h=self.busy,
            cells=len(self.m.slots), staleness=stale, trained_step=tuple(led.trained_step),
            events=tuple(self.m.log),
        )


def simulate(policy: Policy, *, workload: Workload, cluster: ClusterConfig, costs: CostConfig,
             config: SchedulingConfig, start: StartState | None = None) -> SimResult:
    """Run ``policy`` on ``workload`` until every step is trained (from ``start``: a job
    under way; None: an idle cluster at time 0).

    Returns:
        SimResult with the makespan, busy cell-hours, per-group staleness and the event log.
    Raises:
        SimulationStalled, TransitionError, StalenessError on a broken policy.
    """
    return _Sim(policy, workload, cluster, costs, config, start).run()
