"""Elastic mode: cells switch on their own; training streams; late cells join the step.

Rules, applied to every snapshot (no hidden state), in order:

1. **Free cells** (idle trainers, empty draining cells) join the step in progress, or start the
   next one when it is wanted (streaming: one takeable group is enough). At a step boundary
   only as many trainers stay as the takeable backlog needs (``ceil(free * takeable / B)``);
   the others sync back to rollout.
2. **Drain** one rollout cell (never more than one draining at a time) when training needs
   capacity: no cell trains although a step is wanted, or the step in progress has a backlog
   (untaken ready groups) and is not starved, or a rollout cell sits empty with nothing to start.
   The cell to drain is chosen by ``pick_drain`` (fewest live runs, then highest index).
3. **Fill** the remaining rollout cells with admissible runs, most-loaded first, so that the
   least-loaded cells empty out and are cheap to drain.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

from ray_xlong.scheduling.events import Event
from ray_xlong.scheduling.moves import Drain, Move, Sync
from ray_xlong.scheduling.policy import fill_runs, packed, step_wanted, train_on
from ray_xlong.scheduling.state import CellState, ClusterState, Role

DrainPicker = Callable[[ClusterState, Sequence[CellState]], CellState]
"""``pick_drain(state, rollout_cells) -> cell to drain``; rollout_cells is non-empty."""


def fewest_live(state: ClusterState, cells: Sequence[CellState]) -> CellState:
    """Default drain choice: the cell with the fewest live runs (ties: highest index)."""
    return min(cells, key=lambda c: (c.live_runs, -c.cell))


@dataclass(frozen=True, slots=True)
class ElasticPolicy:
    """Independent cell switches with streaming and joining (see the module docstring)."""

    streaming: bool = True
    """Start a step with the first takeable group."""
    joining: bool = True
    """Let cells that empty later join the step in progress."""
    min_rollout_cells: int = 1
    """Never drain below this many rollout cells."""
    pick_drain: DrainPicker = fewest_live
    """Which rollout cell to drain (extension point)."""
    name: str = "elastic"
    """Mode name in tables and logs."""

    def decide(self, state: ClusterState, event: Event) -> tuple[Move, ...]:
        """See :class:`~ray_xlong.scheduling.policy.Policy`."""
        if state.done:
            return ()
        moves = self._free_cells(state)
        drain = self._drain(state, moves)
        moves += drain
        draining = {m.cell for m in drain}
        rollout = [c for c in state.with_role(Role.ROLLOUT) if c.cell not in draining]
        return tuple(moves + fill_runs(state, packed(rollout)))

    def _free_cells(self, state: ClusterState) -> list[Move]:
        trainers = [c for c in state.cells if c.idle_trainer]
        drained = [c for c in state.with_role(Role.DRAINING) if not c.live_runs]
        if state.step >= 0:
            return train_on(state, trainers + drained) if self.joining else []
        if not step_wanted(state, streaming=self.streaming):
            return [Sync(c.cell, state.version) for c in trainers]
        free = trainers + drained
        batch = state.config.batch_groups
        keep = min(len(free), max(1, math.ceil(len(free) * state.takeable_groups / batch)))
        stay = sorted(free, key=lambda c: (c.role is not Role.TRAINING, c.cell))[:keep]
        leave = [c for c in free if c not in stay and c.role is Role.TRAINING]
        return train_on(state, stay) + [Sync(c.cell, state.version) for c in leave]

    def _drain(self, state: ClusterState, moves: list[Move]) -> list[Move]:
        rollout = [c for c in state.with_role(Role.ROLLOUT) if c.ready_at <= state.time]
        if state.with_role(Role.DRAINING):
            return []
        orphaned = state.step >= 0 and not moves and rollout and \
            not any(c.step == state.step for c in state.cells)
        if orphaned:  # the step lost every member (a retired cell): it needs one, whatever
            return [Drain(self.pick_drain(state, rollout).cell)]  # min_rollout_cells says
        if len(rollout) <= self.min_rollout_cells:
            return []
        training = any(c.role is Role.TRAINING for c in state.cells) or moves
        idle_empty = state.startable_runs == 0 and any(not c.live_runs for c in rollout)
        behind = state.step >= 0 and not state.step_starved and state.ready_groups > 0
        if (not training and step_wanted(state, streaming=self.streaming)) or behind or idle_empty:
            return [Drain(self.pick_drain(state, rollout).cell)]
        return []
