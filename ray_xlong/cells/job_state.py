"""The state of one job on cells: what the actuator's loop, recovery, checkpointing and the
metrics read and change — one record, owned by the actuator, handed to the others.

```
RayActuator ──owns──► JobState ◄──takes── Recovery (recovery.py)   rebuilds after a loss
     │                   │      ◄──takes── save / resume (checkpoint.py)
     │                   │      ◄──reads── job_result (metrics.py)
     └─ implements JobActions (protocols.py): deliver, requeue, rcall, watch_runs
                         │
                         ├─ m: the CellMachine (roles, live runs, ledger, event log)
                         ├─ pending refs, ended / held runs, micro-batch queue, in flight
                         ├─ chain of runner calls, awake learners, trained run ids, stats
                         ├─ spool bookkeeping, fault records, retired cells, t0 / now()
                         └─ ray: the Ray calls (ray_edge.RayCalls; a fake in unit tests)
```

Invariants: every held run (``held_runs``) is in ``ended`` until a step takes its group, then
in exactly one queued, in-flight or trained micro-batch; ``pending`` holds only refs of cells
that are not retired; ``faults`` grows only (one record per recovery).
"""

from __future__ import annotations

import collections
import dataclasses
import time
from typing import TYPE_CHECKING, Any

from ray_xlong.cells.learner_group import ElasticLearnerGroup, MicroBatch
from ray_xlong.cells.ray_edge import RayCalls
from ray_xlong.cells.records import EndedRun, FaultRecord, Pending, StepObserver
from ray_xlong.cells.spool import RunSpool
from ray_xlong.scheduling import CellMachine, Policy

if TYPE_CHECKING:  # config.py imports pool.py; this module stays below both
    from ray_xlong.cells.config import CellJobConfig
    from ray_xlong.cells.protocols import CellHost

INF = float("inf")
"""``ready_at`` of a busy cell (its actors report back when it is ready)."""


def _stats() -> collections.defaultdict[str, list[float]]:
    return collections.defaultdict(list)


def _ended() -> collections.defaultdict[int, list[EndedRun]]:
    return collections.defaultdict(list)


@dataclasses.dataclass(eq=False)
class JobState:
    """One job's state on cells (module docstring); mutable, one per driver."""

    cfg: CellJobConfig
    """The job."""
    policy: Policy
    """The scheduling policy (the simulator's objects)."""
    pool: CellHost
    """The cells (``pool.CellPool``, or a fake one in tests)."""
    ray: RayCalls
    """Ray calls other than actor calls (``ray_edge.RayEdge``)."""
    m: CellMachine
    """Roles, live runs, ledger and event log (shared with the simulator)."""
    version_offset: int = 0
    """Policy version of scheduler step 0 (a job restored at version v)."""
    observer: StepObserver | None = None
    """Told about runs and steps as they happen."""
    spool: RunSpool | None = None
    """The run spool (``CellJobConfig.spool_dir``)."""
    learners: ElasticLearnerGroup | None = None
    """The elastic learner group (built when the job starts or resumes)."""
    pending: dict[Any, Pending] = dataclasses.field(default_factory=dict)
    """Refs the driver waits for."""
    ended: collections.defaultdict[int, list[EndedRun]] = dataclasses.field(
        default_factory=_ended)
    """Ended runs not yet taken by a step, by group."""
    held_runs: dict[str, EndedRun] = dataclasses.field(default_factory=dict)
    """Delivered runs not yet in a finished step, by run id."""
    queue: collections.deque[tuple[MicroBatch, bool]] = dataclasses.field(
        default_factory=collections.deque)
    """Micro-batches of the step to train, with whether their weight is counted already."""
    in_flight: dict[int, float] = dataclasses.field(default_factory=dict)
    """Cell → job time its micro-batch was dispatched."""
    chain: dict[int, Any] = dataclasses.field(default_factory=dict)
    """Cell → ref of its runner's last ordered call."""
    awake: set[int] = dataclasses.field(default_factory=set)
    """Cells whose learner is awake (their switch finished)."""
    stats: collections.defaultdict[str, list[float]] = dataclasses.field(default_factory=_stats)
    """Timings and counts by name (``RayResult.timings``)."""
    trained: dict[int, list[str]] = dataclasses.field(default_factory=dict)
    """Step → run ids it trained."""
    token_staleness: int = 0
    """Max over dispatched micro-batches of (step − oldest version of their tokens)."""
    spooled_trained: set[str] = dataclasses.field(default_factory=set)
    """Trained run ids still in the spool (dropped with the next checkpoint)."""
    faults: list[FaultRecord] = dataclasses.field(default_factory=list)
    """One record per recovery (``RayResult.faults``)."""
    retired: set[int] = dataclasses.field(default_factory=set)
    """Cells whose node was lost, not yet rebuilt."""
    checkpoint_ref: Any = None
    """Ref of the last checkpoint save started (``checkpoint.save``)."""
    resumed_at: float | None = None
    """Unix time a resume from a checkpoint finished (None: not resumed)."""
    t0: float = dataclasses.field(default_factory=time.monotonic)
    """``time.monotonic()`` at job time 0."""

    @property
    def cells(self) -> list[Any]:
        """The pool's cells, by index (each with its ``runner`` and ``learner`` handle)."""
        return self.pool.cells

    def now(self) -> float:
        """Job time: wall seconds since ``t0``."""
        return time.monotonic() - self.t0
