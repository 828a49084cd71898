"""The records the cell runtime passes between its parts (frozen, one docstring per field): a
call the driver waits for, a run that ended and is not trained yet, one recovery from a loss,
what an observer of a job is told, and the error of an actor loss with no recovery.
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
    """``ended`` (a runner's ``wait_ended``), ``started``, ``switch``, ``load`` (an awake
    Learner that joined a step behind loads its state), ``sync``, ``micro`` or ``eval``."""
    cell: int
    """The cell whose actor answers."""
    issued: float
    """Job time it was sent."""
    payload: Any = None
    """``ended``: the ref of the episodes of the runs it reports (left where they are)."""
    version: int = -1
    """``sync``: the policy version of the weights the runner was sent."""


@dataclasses.dataclass(frozen=True, slots=True)
class EndedRun:
    """A run that ended and is not trained yet, as the driver holds it: numbers and a ref."""

    digest: RunDigest
    """Its reward, status and counts."""
    payload: Any
    """Ref of the episode list holding it (in the object store where it was processed)."""
    cell: int
    """The cell whose runner processed it (where the payload lives)."""


@dataclasses.dataclass(frozen=True, slots=True)
class FaultRecord:
    """One recovery from a loss (``RayResult.faults``; the fault audit reads them)."""

    kind: str
    """``runner`` / ``learner`` / ``both`` (an actor rebuilt in place, or both), ``node`` (the
    cell retired with its node), ``node_returned`` (a retired cell rebuilt), ``driver`` (a new
    driver resumed from a checkpoint), ``state`` (every holder of the state lost: the last
    checkpoint reloaded and the steps since replayed from the spool; ``runs_from_spool`` = runs
    replayed) or ``transfer`` (a joining cell's state did not arrive — its holder's node lost
    mid-transfer, or its object-store copy — so its Learner was rebuilt: the consequence of
    another loss, not a loss of its own)."""
    cell: int
    """The cell (-1: ``driver``)."""
    why: str
    """The call that found the loss (empty for ``node_returned``)."""
    t: float
    """Job time the loss was found (seconds)."""
    recover_s: float
    """Seconds the recovery took."""
    runs_rerun: int = 0
    """Live runs started again (same ids) because their runner or node was lost."""
    runs_from_spool: int = 0
    """Runs that had ended into the spool and were delivered from it."""
    micro_batches_redone: int = 0
    """Micro-batches of the step trained again (the lost learner's share)."""
    retired: bool = False
    """The cell left the job until its placement group is placed again."""


class StepObserver(Protocol):
    """What a caller learns as a job runs (``stepping.StepRecorder``); every method optional
    in spirit: an observer that ignores one just passes."""

    def delivered(self, digest: RunDigest) -> None:
        """A run ended and reached the driver."""

    def taken(self, step: int, micro: Sequence[MicroBatch], stats: BatchStats) -> None:
        """Step ``step`` took runs: their micro-batches and processor counts."""

    def staleness(self, step: int, stale: int) -> None:
        """A micro-batch of step ``step`` holds tokens ``stale`` versions old."""
