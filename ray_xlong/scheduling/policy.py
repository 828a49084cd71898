"""The policy interface and the small helpers every mode shares.

A policy is a plain object with a ``name`` and a pure ``decide(state, event) -> tuple[Move, ...]``:
the moves depend only on the snapshot and the event, never on hidden mutable state, so the same
policy object drives the simulator and the Ray driver and replays deterministically. The
actuator applies the moves in order (a ``StartTraining`` then ``JoinStep`` in one answer is fine).

Contract of ``decide`` (checked by ``tests/scheduling/test_policies.py``):
  Args:
    state: the cluster *after* ``event`` was applied.
    event: what just happened (``Event.kind`` in ``events.KINDS``).
  Returns:
    moves valid for :class:`~ray_xlong.scheduling.machine.CellMachine` applied in order.
"""

from __future__ import annotations

from typing import Iterable, Protocol

from ray_xlong.scheduling.events import Event
from ray_xlong.scheduling.moves import JoinStep, Move, StartRuns, StartTraining
from ray_xlong.scheduling.state import CellState, ClusterState, Role


class Policy(Protocol):
    """What a mode is: a name and a pure decide function."""

    name: str

    def decide(self, state: ClusterState, event: Event) -> tuple[Move, ...]:
        """Moves to make now (see the module docstring)."""
        ...


def fill_runs(state: ClusterState, cells: Iterable[CellState]) -> list[Move]:
    """Start admissible runs on ``cells`` in the given order, each up to its free slots.

    Only ready rollout cells are used. Returns StartRuns moves (possibly empty).
    """
    budget = state.startable_runs
    moves: list[Move] = []
    for cell in cells:
        if budget <= 0:
            break
        if cell.role is not Role.ROLLOUT or cell.ready_at > state.time or cell.free_slots <= 0:
            continue
        n = min(budget, cell.free_slots)
        moves.append(StartRuns(cell.cell, n))
        budget -= n
    return moves


def packed(cells: Iterable[CellState]) -> list[CellState]:
    """Most-loaded first (then lowest index): packs runs so that other cells can empty."""
    return sorted(cells, key=lambda c: (-c.live_runs, c.cell))


def spread(cells: Iterable[CellState]) -> list[CellState]:
    """Least-loaded first (then lowest index)."""
    return sorted(cells, key=lambda c: (c.live_runs, c.cell))


def train_on(state: ClusterState, cells: Iterable[CellState]) -> list[Move]:
    """Put ``cells`` (empty or idle trainers) on the step in progress, or start the next step."""
    moves: list[Move] = []
    step = state.step
    for cell in cells:
        if step < 0:
            step = state.version
            moves.append(StartTraining(cell.cell, step))
        else:
            moves.append(JoinStep(cell.cell, step))
    return moves


def step_wanted(state: ClusterState, *, streaming: bool) -> bool:
    """Can the next step start: a full batch takeable, or (streaming) any group takeable."""
    if state.step >= 0 or state.done:
        return False
    need = 1 if streaming else state.config.batch_groups
    return state.takeable_groups >= need
