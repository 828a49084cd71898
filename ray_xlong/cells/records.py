"""The records the cell runtime passes between its parts (frozen, one docstring per field): a
call the driver waits for, a run that ended and is not trained yet, what an observer of a job
is told, and the error of an actor loss with no recovery.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol, Sequence

from ray_xlong.cells.learner_group import MicroBatch
from ray_xlong.trajectory import BatchStats
from ray_xlong.trajectory.per_run import RunDigest


class CellActorDied(RuntimeError):
    """A cell's runner or learner actor died (the message names the cell and the call)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Pending:
    """A call the driver waits for."""

    kind: str
    """``ended`` (a runner's ``wait_ended``), ``started``, ``switch``, ``sync`` or ``micro``."""
    cell: int
    """The cell whose actor answers."""
    issued: float
    """Job time it was sent."""
    payload: Any = None
    """``ended``: the ref of the episodes of the runs it reports (left where they are)."""


@dataclasses.dataclass(frozen=True, slots=True)
class EndedRun:
    """A run that ended and is not trained yet, as the driver holds it: numbers and a ref."""

    digest: RunDigest
    """Its reward, status and counts."""
    payload: Any
    """Ref of the episode list holding it (in the object store where it was processed)."""
    cell: int
    """The cell whose runner processed it (where the payload lives)."""


class StepObserver(Protocol):
    """What a caller learns as a job runs (``stepping.StepRecorder``); every method optional
    in spirit: an observer that ignores one just passes."""

    def delivered(self, digest: RunDigest) -> None:
        """A run ended and reached the driver."""

    def taken(self, step: int, micro: Sequence[MicroBatch], stats: BatchStats) -> None:
        """Step ``step`` took runs: their micro-batches and processor counts."""

    def staleness(self, step: int, stale: int) -> None:
        """A micro-batch of step ``step`` holds tokens ``stale`` versions old."""
