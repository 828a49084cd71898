"""Moves: what a policy asks an actuator to do, one frozen record per action.

A policy never acts; it returns moves. The simulator applies them to a virtual clock, the Ray
driver to placement groups and actors. Every move is validated by
:class:`~ray_xlong.scheduling.machine.CellMachine` before any actuator touches a cell.

```
rollout ──Drain──► draining ──(empty)──StartTraining / JoinStep / Reserve──► training
   ▲  └────────(empty)──StartTraining / JoinStep / Reserve──────────────────────┘ │
   └──────────── syncing ◄──────────────Sync (not in a step)─────────────────────┘
```
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class StartRuns:
    """Start the next ``count`` admissible runs on a rollout cell (they stay on it)."""

    cell: int
    """Target cell; must be in role rollout with ``count`` free slots."""
    count: int
    """How many runs; at most the cell's free slots and the admissible runs left."""


@dataclass(frozen=True, slots=True)
class Drain:
    """Take no new runs on ``cell``; its live runs continue to the end."""

    cell: int
    """A rollout cell."""


@dataclass(frozen=True, slots=True)
class Reserve:
    """Move an empty rollout / draining cell to training without a step (it waits for one)."""

    cell: int
    """An empty rollout or draining cell."""


@dataclass(frozen=True, slots=True)
class StartTraining:
    """Begin step ``step`` with ``cell`` as its first trainer."""

    cell: int
    """An empty rollout / draining cell, or an idle training cell."""
    step: int
    """Must equal the current policy version (steps are applied in order)."""


@dataclass(frozen=True, slots=True)
class JoinStep:
    """Add ``cell`` to the step in progress (more training capacity, same update)."""

    cell: int
    """An empty rollout / draining cell, or an idle training cell."""
    step: int
    """Must be the step in progress."""


@dataclass(frozen=True, slots=True)
class Sync:
    """Load weights ``version`` into an idle training cell and return it to rollout."""

    cell: int
    """An idle training cell (not in a step)."""
    version: int
    """Must equal the current policy version."""


Move = StartRuns | Drain | Reserve | StartTraining | JoinStep | Sync
"""Any move a policy may return."""
