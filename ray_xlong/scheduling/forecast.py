"""Forecast mode: elastic, but sized by the work that is certain to arrive, and drained early.

Elastic (``elastic.py``) drains a cell only once training is short of capacity, and a drain
lasts until the cell's *newest* run ends: with hour-long runs and a run timeout, that is hours
(``paper-2.4t``: 41% of runs reach the 6 h timeout, so a full cell empties ~6 h after its last
start). Training then waits, the backlog closes admission, and the cluster falls into
colocated-like waves. This policy looks ahead instead, using two facts the operator knows:

* every live run ends within ``horizon_h`` (the harness's run timeout), so the ready groups and
  the live runs (``live_runs / G`` groups) are work that *will* be trainable within the horizon;
* one training cell trains ``train_groups_per_cell_h`` groups an hour (the cost model).

```
horizon = max(horizon_h, age of the oldest live run)      (adapts when run horizons grow)
need    = (ready_groups + live_runs / G) / (train_groups_per_cell_h * horizon)
target  = round(need), at least 1 while need > 0       (nearest: see below)
supply = cells training + cells draining        (syncing cells are on their way back)
supply < target  ->  drain the rollout cell whose newest run is oldest (it empties first)
```

The horizon adapts (issue 15): when agent horizons grow during training (the operator raises
the run timeout as the policy learns, or a new task mix runs longer), a live run older than
``horizon_h`` proves that runs now take longer, so work arrives more slowly than ``horizon_h``
says; sizing by the stale horizon would keep too many cells training.

The target is the *nearest* whole number of cells, not the next one up (issue 15): the
staleness bound lets training run behind by up to ``b`` steps, so a fraction of a cell of
work is a backlog that waits, and the backlog (``ready_groups``) raises ``need`` until a cell
drains for it; rounding up kept a mostly idle extra trainer whenever ``need`` was just over a
whole number (``paper-2.4t-drift``: 19.5% of cell-time training for 16% of work).
Measured (seed 0, ``benchmarks/scheduler_sim.py``): drift 98.25 h → 95.7 h, shift 88.06 h →
86.1 h, stationary 69.14 h → 68.9 h.

Rules, applied to every snapshot (no hidden state):

1. **Free cells** (idle trainers, empty draining cells, empty rollout cells with nothing to
   start) join the step in progress, or start the next one when it is wanted (streaming). At a
   step boundary, and while no step is wanted, idle trainers beyond ``target`` sync back to
   rollout if rollout could start runs on them; those within it stay (work is on its way:
   re-draining a cell would cost hours).
2. **Drain** ``target - supply`` rollout cells, newest-run-oldest first (empty cells first),
   never below ``min_rollout_cells`` rollout cells.
3. **Fill** the remaining rollout cells with admissible runs, most-loaded first.

Invariants: pure and deterministic (``decide`` reads only the snapshot); every move is one the
:class:`~ray_xlong.scheduling.machine.CellMachine` accepts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ray_xlong.scheduling.events import Event
from ray_xlong.scheduling.moves import Drain, Move, Sync
from ray_xlong.scheduling.policy import fill_runs, packed, step_wanted, train_on
from ray_xlong.scheduling.state import ClusterState, Role


@dataclass(frozen=True, slots=True)
class ForecastPolicy:
    """Elastic cells sized by the work certain to arrive within the run timeout."""

    train_groups_per_cell_h: float
    """Groups one training cell trains per hour (operator's estimate from the cost model)."""
    horizon_h: float
    """Every live run ends within this many hours of its start (the run timeout)."""
    streaming: bool = True
    """Start a step with the first takeable group."""
    joining: bool = True
    """Let cells that empty later join the step in progress."""
    min_rollout_cells: int = 1
    """Never drain below this many rollout cells."""
    name: str = "forecast"
    """Mode name in tables and logs."""

    def __post_init__(self) -> None:
        for field in ("train_groups_per_cell_h", "horizon_h"):
            if not getattr(self, field) > 0:
                raise ValueError(f"ForecastPolicy.{field}: must be > 0, got {getattr(self, field)}")

    def decide(self, state: ClusterState, event: Event) -> tuple[Move, ...]:
        """See :class:`~ray_xlong.scheduling.policy.Policy`."""
        if state.done:
            return ()
        target = self.target_trainers(state)
        moves = self._free_cells(state, target)
        drain = self._drain(state, target, moves)
        busy = {m.cell for m in moves + drain}
        rollout = [c for c in state.with_role(Role.ROLLOUT) if c.cell not in busy]
        return tuple(moves + drain + fill_runs(state, packed(rollout)))

    def target_trainers(self, state: ClusterState) -> int:
        """Training cells the work of the next ``horizon_h`` hours needs (see module docstring)."""
        groups = state.ready_groups + state.live_runs / state.config.runs_per_group
        need = groups / (self.train_groups_per_cell_h * self.horizon(state))
        near = max(1, math.floor(need + 0.5)) if need > 1e-9 else 0
        return max(0, min(near, len(state.cells) - self.min_rollout_cells))

    def horizon(self, state: ClusterState) -> float:
        """``horizon_h``, or the age of the oldest live run when that is longer (hours)."""
        oldest = min((c.oldest_run_start for c in state.cells if c.live_runs), default=state.time)
        return max(self.horizon_h, state.time - oldest)

    def _free_cells(self, state: ClusterState, target: int) -> list[Move]:
        trainers = [c for c in state.cells if c.idle_trainer]
        empty = [c for c in state.with_role(Role.DRAINING) if not c.live_runs]
        if state.startable_runs == 0:  # nothing to start: an empty rollout cell is free too
            empty += [c for c in state.with_role(Role.ROLLOUT)
                      if not c.live_runs and c.ready_at <= state.time]
        if state.step >= 0:
            return train_on(state, trainers + empty) if self.joining else []
        # back to rollout only beyond the target, and only if rollout could start a run there
        stay = trainers if state.startable_runs == 0 else trainers[:max(0, target - len(empty))]
        leave = [Sync(c.cell, state.version) for c in trainers if c not in stay]
        if not step_wanted(state, streaming=self.streaming):
            return leave
        if not stay and not empty:  # a wanted step needs one trainer: keep one back
            stay, leave = trainers[:1], leave[1:]
        return train_on(state, stay + empty) + leave

    def _drain(self, state: ClusterState, target: int, moves: list[Move]) -> list[Move]:
        moved = {m.cell for m in moves}
        synced = {m.cell for m in moves if isinstance(m, Sync)}
        entering = sum(1 for c in state.with_role(Role.ROLLOUT) if c.cell in moved)
        supply = len(state.with_role(Role.TRAINING, Role.DRAINING)) - len(synced) + entering
        rollout = [c for c in state.with_role(Role.ROLLOUT)
                   if c.ready_at <= state.time and c.cell not in moved]
        count = min(target - supply, len(rollout) - self.min_rollout_cells)
        order = sorted(rollout, key=lambda c: (c.live_runs > 0, c.newest_run_start,
                                               c.live_runs, c.cell))
        return [Drain(c.cell) for c in order[:max(0, count)]]
