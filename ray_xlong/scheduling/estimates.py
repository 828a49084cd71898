"""What a job's own event log says about its workload and costs (learned online, pure).

An :class:`EventEstimator` reads the event log as it grows (``observe(events)``, fed by
:meth:`~ray_xlong.scheduling.machine.CellMachine.settle` to any policy with an ``observe``
method) and estimates, in the log's time unit (simulator hours, Ray seconds):

* **run durations** of the most recent ``window_runs`` started runs, with the Kaplan-Meier
  estimator: a live run is a *censored* observation (it has lasted at least its age), so the
  estimate is not biased towards the short runs that end first. The probability mass beyond
  the longest time observed goes to that time (runs last at least that long);
* **training cell-time per group**: per ended step, the cell-time its cells were on it, ready,
  and not starved (from ``step_starved`` until a group completes; the fixed step cost
  included), divided by the batch size; the mean over the last ``window_steps`` steps (the
  job's first step, which pays a learner warm-up, left out once later steps are seen);
* **step finish** (Ray logs ``micro_batch`` events): last micro-batch to step end; the
  training cell-time of such a step stops at its last micro-batch;
* **switch and sync costs**: a ``role: training`` (or ``syncing``) event to the cell's next
  ``ready`` event; medians;
* **horizon**: the longest run seen so far, or the age of the oldest live run when longer.

Invariants: O(1) work per event; the estimates depend only on the events observed.
"""

from __future__ import annotations

import bisect
import statistics
from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class JobEstimates:
    """A snapshot of the estimates (log time unit)."""

    duration_quantiles: tuple[float, ...]
    """Run durations at evenly spaced probabilities (Kaplan-Meier, recent runs): a sample of
    the current run-length distribution."""
    train_per_group: float
    """Cell-time to train one group (fixed step cost included)."""
    to_train: float
    """Rollout → training switch (0 when none was seen)."""
    sync: float
    """Training → rollout sync (0 when none was seen)."""
    step_finish: float
    """Last micro-batch → step end (reduce, optimizer, weight push): the fixed step cost, seen
    where the log has ``micro_batch`` events (the Ray driver), else 0 (then it is part of
    :attr:`train_per_group`)."""
    horizon: float
    """Longest run seen, or the age of the oldest live run when longer."""
    runs_ended: int
    """Runs seen to end."""
    steps_ended: int
    """Steps seen to end."""

    @property
    def mean_duration(self) -> float:
        """Mean of :attr:`duration_quantiles`."""
        return statistics.fmean(self.duration_quantiles)

    def moved(self, other: "JobEstimates", tolerance: float) -> bool:
        """Mean run duration or training cost differ by more than ``tolerance`` (relative)."""
        def far(a: float, b: float) -> bool:
            return abs(a - b) > tolerance * max(abs(b), 1e-12)
        return far(self.mean_duration, other.mean_duration) or \
            far(self.train_per_group, other.train_per_group)


class EventEstimator:
    """Learns :class:`JobEstimates` from an event log (see the module docstring)."""

    def __init__(self, *, batch_groups: int | None = None, group_size: int | None = None,
                 window_runs: int = 2048,
                 window_steps: int = 8, quantiles: int = 200) -> None:
        self.batch_groups, self.group_size = batch_groups, group_size
        self.group_runs: dict[int, int] = {}  # group -> runs ended (until complete)
        self.window_runs, self.quantiles = window_runs, quantiles
        self.start: dict[int, float] = {}  # live run -> start
        self.recent: deque[int] = deque(maxlen=window_runs)  # runs in start order
        self.ended: dict[int, float] = {}  # run -> duration (recent runs only)
        self.runs_ended = 0
        self.longest = 0.0
        self.step_cost: deque[float] = deque(maxlen=window_steps)
        self.steps_total = 0
        self.finish: deque[float] = deque(maxlen=64)
        self.last_micro: tuple[float, float] | None = None  # (time, cell-time) of the last one
        self.switch: deque[float] = deque(maxlen=64)
        self.syncs: deque[float] = deque(maxlen=64)
        self.pending: dict[int, tuple[str, float]] = {}  # cell -> (role, since) until ready
        self.on_step: set[int] = set()
        self.step_groups_seen = 0
        self.starved = False
        self.clock = 0.0
        self.acc = 0.0  # cell-time of the step in progress

    # -- input ---------------------------------------------------------------------------
    def observe(self, events) -> None:
        """Fold new events (in log order) into the estimates."""
        for e in events:
            self._integrate(e.time)
            handler = _HANDLERS.get(e.kind)
            if handler is not None:
                handler(self, e)

    def _integrate(self, t: float) -> None:
        if t > self.clock and not self.starved:
            working = sum(1 for c in self.on_step if c not in self.pending)
            self.acc += (t - self.clock) * working
        self.clock = max(self.clock, t)

    def _run_started(self, e) -> None:
        if e.run in self.start or e.run in self.ended:
            self.ended.pop(e.run, None)
        else:
            if len(self.recent) == self.recent.maxlen:
                self.ended.pop(self.recent[0], None)
            self.recent.append(e.run)
        self.start[e.run] = e.time

    def _run_ended(self, e) -> None:
        done = self.group_runs.get(e.group, 0) + 1
        self.group_runs[e.group] = done
        if self.group_size and done >= self.group_size:
            self.starved = False  # a group became ready: a starved step takes it now
            del self.group_runs[e.group]
        began = self.start.pop(e.run, None)
        if began is None:
            return
        d = e.time - began
        self.ended[e.run] = d
        self.runs_ended += 1
        self.longest = max(self.longest, d)

    def _role(self, e) -> None:
        if e.role in ("training", "syncing"):
            self.pending[e.cell] = (e.role, e.time)

    def _ready(self, e) -> None:
        role, since = self.pending.pop(e.cell, ("", e.time))
        if role == "training":
            self.switch.append(e.time - since)
        elif role == "syncing":
            self.syncs.append(e.time - since)

    def _step_started(self, e) -> None:
        self.on_step, self.acc, self.starved, self.last_micro = {e.cell}, 0.0, False, None

    def _step_joined(self, e) -> None:
        self.on_step.add(e.cell)

    def _step_starved(self, e) -> None:
        self.starved = True

    def _micro_batch(self, e) -> None:
        self.last_micro = (e.time, self.acc)

    def _step_ended(self, e) -> None:
        if self.last_micro is not None:  # the Ray driver: training ends at the last micro-batch
            self.finish.append(e.time - self.last_micro[0])
            self.acc = self.last_micro[1]
        self.last_micro = None
        self.step_cost.append(self.acc)
        self.steps_total += 1
        self.on_step, self.acc, self.starved = set(), 0.0, False

    def _cell_gone(self, e) -> None:
        self.on_step.discard(e.cell)
        self.pending.pop(e.cell, None)

    # -- output --------------------------------------------------------------------------
    @property
    def steps_ended(self) -> int:
        """Steps seen to end (within the window)."""
        return len(self.step_cost)

    def horizon(self, now: float) -> float:
        """Longest run seen, or the age of the oldest live run when longer (0: nothing seen)."""
        oldest = min(self.start.values(), default=now)
        return max(self.longest, now - oldest)

    def train_per_group(self, batch_groups: int | None = None) -> float | None:
        """Mean cell-time a group's training took over the recent steps (None: no step)."""
        b = batch_groups or self.batch_groups
        if not self.step_cost or not b:
            return None
        costs = list(self.step_cost)
        if self.steps_total > len(costs) or len(costs) == 1:
            return statistics.fmean(costs) / b
        return statistics.fmean(costs[1:]) / b  # the job's first step pays a warm-up

    def duration_quantiles(self, now: float) -> tuple[float, ...]:
        """Kaplan-Meier quantiles of the recent runs' durations (empty: no run started)."""
        obs = []
        for run in self.recent:
            if run in self.ended:
                obs.append((self.ended[run], 1))
            elif run in self.start:
                obs.append((max(0.0, now - self.start[run]), 0))
        if not obs:
            return ()
        obs.sort()
        times, surv = [], []
        s, at_risk, i = 1.0, len(obs), 0
        while i < len(obs):  # one product-limit factor per distinct time
            t, deaths, n = obs[i][0], 0, 0
            while i < len(obs) and obs[i][0] == t:
                deaths, n, i = deaths + obs[i][1], n + 1, i + 1
            if deaths:
                s *= 1 - deaths / at_risk
                times.append(t)
                surv.append(1 - s)  # CDF at t
            at_risk -= n
        tail = obs[-1][0]  # mass beyond the last observation sits at the longest time seen
        out = []
        for k in range(self.quantiles):
            p = (k + 0.5) / self.quantiles
            j = bisect.bisect_left(surv, p)
            out.append(times[j] if j < len(times) else max(tail, times[-1] if times else tail))
        return tuple(out)

    def configure(self, batch_groups: int, group_size: int) -> None:
        """The job's batch shape (policies learn it from their first snapshot)."""
        self.batch_groups, self.group_size = batch_groups, group_size

    def estimates(self, now: float, batch_groups: int | None = None,
                  *, min_steps: int = 1, min_runs: int = 1) -> JobEstimates | None:
        """Current :class:`JobEstimates`, or None until ``min_steps`` steps and ``min_runs``
        runs have ended."""
        per_group = self.train_per_group(batch_groups)
        if per_group is None or self.steps_ended < min_steps or self.runs_ended < min_runs:
            return None
        return JobEstimates(
            duration_quantiles=self.duration_quantiles(now), train_per_group=per_group,
            to_train=statistics.median(self.switch) if self.switch else 0.0,
            sync=statistics.median(self.syncs) if self.syncs else 0.0,
            step_finish=statistics.median(self.finish) if self.finish else 0.0,
            horizon=self.horizon(now), runs_ended=self.runs_ended, steps_ended=self.steps_ended,
        )


_HANDLERS = {
    "run_started": EventEstimator._run_started, "run_restarted": EventEstimator._run_started,
    "run_ended": EventEstimator._run_ended, "role": EventEstimator._role,
    "ready": EventEstimator._ready, "step_started": EventEstimator._step_started,
    "step_joined": EventEstimator._step_joined, "step_starved": EventEstimator._step_starved,
    "step_ended": EventEstimator._step_ended, "micro_batch": EventEstimator._micro_batch, "cell_retired": EventEstimator._cell_gone,
}
"""Event kind → update (kinds not listed change no estimate)."""
