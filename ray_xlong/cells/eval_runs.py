"""Evaluation runs on rollout cells: held-out runs placed beside the training runs, never trained.

```
submit(round, specs) ──► queue ──► actuator tick: place on cells in rollout, ready, not retired
 (any thread)                       (≤ slots_per_cell evaluation runs a cell; runner call
                                     ``start_eval_runs``, ordered after its earlier role calls)
                                                 │
   runner: an evaluation run ends ─► EvalOutcome (reward, version, cell) — not spooled, not in
           ``wait_ended``: the scheduler never sees it, no step trains it
           the cell leaves rollout (``suspend``) ─► its live evaluation runs are cancelled and
           reported preempted: they go back to the queue and start again on another cell
                                                 │
take_eval ─► report(cell, EvalReport) ─► outcomes of the round ─► done(round) / close(round)
```

Invariants: a spec is queued, live on exactly one cell, or ended (once); an outcome counts only
for a round still open; a cell whose runner was replaced or that was retired has its live
evaluation runs queued again (``lost``). Evaluation never delays a role switch: a cell that
trains cancels them instead of waiting. Thread-safe (RLlib's parallel evaluation waits in one
thread while the training thread ticks the actuator); no Ray here.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
from typing import Any, Sequence

from ray_xlong.cells.runs import RunSpec


@dataclasses.dataclass(frozen=True, slots=True)
class EvalOutcome:
    """How one evaluation run ended (a few numbers: what the driver reads of it)."""

    run_id: str
    """The evaluation run's id (``RunSpec.run_id``)."""
    group_id: str
    """Its held-out instance (runs of one instance share it: pass@k is per instance)."""
    reward: float
    """The task's score (0.0 for a run whose harness failed)."""
    cell: int
    """The rollout cell that ran it."""
    version: int
    """Oldest policy version its model calls used (the engine's version if it made none)."""
    failed: bool = False
    """The harness raised instead of returning a run."""


@dataclasses.dataclass(frozen=True, slots=True)
class EvalReport:
    """What a runner's ``take_eval`` returns: evaluation runs that ended, and those it cancelled
    since the last call (its cell left rollout)."""

    ended: tuple[EvalOutcome, ...] = ()
    """Runs that ended."""
    preempted: tuple[str, ...] = ()
    """Run ids cancelled before they ended (to start again elsewhere)."""


@dataclasses.dataclass(frozen=True, slots=True)
class EvalPlacement:
    """Where an evaluation run was started (one per start; a preempted run has several)."""

    run_id: str
    """The run."""
    cell: int
    """The cell it was sent to."""
    role: str
    """That cell's role when it was placed (always ``rollout``)."""


class EvalRuns:
    """The evaluation runs of a job (module docstring): queue, live runs by cell, outcomes."""

    def __init__(self) -> None:
        self._lock = threading.Condition()
        self.queue: collections.deque[RunSpec] = collections.deque()
        self.live: dict[int, dict[str, RunSpec]] = collections.defaultdict(dict)
        self.runner_of: dict[int, Any] = {}
        self.round_of: dict[str, int] = {}
        self.planned: dict[int, int] = {}
        self.outcomes: dict[int, list[EvalOutcome]] = {}
        self.placements: list[EvalPlacement] = []
        """Every placement so far (which cell, in which role, ran what)."""
        self.preempted = 0
        """Evaluation runs cancelled by a role switch (and started again) so far."""
        self.ended: list[EvalOutcome] = []
        """Every outcome reported so far, in order (rounds closed or not)."""

    def submit(self, round_: int, specs: Sequence[RunSpec]) -> None:
        """Queue round ``round_`` (its runs are placed by the actuator's next ticks)."""
        with self._lock:
            if round_ in self.planned:
                raise ValueError(f"EvalRuns.submit: round {round_} was submitted already")
            self.planned[round_] = len(specs)
            self.outcomes[round_] = []
            for s in specs:
                self.round_of[s.run_id] = round_
            self.queue.extend(specs)

    def has_round(self, round_: int) -> bool:
        with self._lock:
            return round_ in self.planned

    def take_queued(self, cell: int, room: int) -> list[RunSpec]:
        """Up to ``room`` queued runs for ``cell`` (pops them; see :meth:`placed`)."""
        with self._lock:
            n = min(room, len(self.queue))
            return [self.queue.popleft() for _ in range(n)]

    def placed(self, cell: int, specs: Sequence[RunSpec], *, runner: Any, role: str) -> None:
        """``specs`` were sent to ``cell``'s runner ``runner`` while ``cell`` was ``role``."""
        with self._lock:
            self.runner_of[cell] = runner
            for s in specs:
                self.live[cell][s.run_id] = s
                self.placements.append(EvalPlacement(s.run_id, cell, role))

    def live_on(self, cell: int) -> int:
        """Evaluation runs live on ``cell``."""
        with self._lock:
            return len(self.live.get(cell, {}))

    def cells(self) -> list[int]:
        """Cells with live evaluation runs."""
        with self._lock:
            return [c for c, runs in self.live.items() if runs]

    def runner(self, cell: int) -> Any:
        """The runner handle ``cell``'s live evaluation runs were sent to."""
        with self._lock:
            return self.runner_of.get(cell)

    def report(self, cell: int, report: EvalReport) -> None:
        """What ``cell``'s runner said: outcomes recorded, preempted runs queued again."""
        with self._lock:
            live = self.live[cell]
            for o in report.ended:
                if live.pop(o.run_id, None) is None:
                    continue
                self.ended.append(o)
                round_ = self.round_of.pop(o.run_id, None)
                if round_ in self.outcomes:
                    self.outcomes[round_].append(o)
            for run_id in report.preempted:
                spec = live.pop(run_id, None)
                if spec is not None:
                    self.preempted += 1
                    self._requeue(spec)
            self._lock.notify_all()

    def lost(self, cell: int) -> int:
        """``cell``'s runner is gone (replaced, or its node retired): its live evaluation
        runs go back to the queue. Returns how many."""
        with self._lock:
            runs = list(self.live.pop(cell, {}).values())
            self.runner_of.pop(cell, None)
            for spec in runs:
                self._requeue(spec)
            return len(runs)

    def _requeue(self, spec: RunSpec) -> None:
        if self.round_of.get(spec.run_id) in self.outcomes:   # its round is still open
            self.queue.appendleft(spec)

    def done(self, round_: int) -> bool:
        """Whether every run of ``round_`` ended."""
        with self._lock:
            return len(self.outcomes.get(round_, ())) >= self.planned.get(round_, 0)

    def wait(self, timeout_s: float) -> None:
        """Block until a report arrives or ``timeout_s`` passed."""
        with self._lock:
            self._lock.wait(timeout_s)

    def close(self, round_: int) -> list[EvalOutcome]:
        """The round's outcomes; runs of it not ended yet are forgotten (their outcomes, if
        they come, are dropped; queued ones are not placed)."""
        with self._lock:
            out = self.outcomes.pop(round_, [])
            self.queue = collections.deque(s for s in self.queue
                                           if self.round_of.get(s.run_id) != round_)
            return out
