"""Snapshots a policy decides on: cells with roles, the step in progress, group counts.

A :class:`ClusterState` is an immutable picture of the cluster at one instant, built by
:meth:`~ray_xlong.scheduling.machine.CellMachine.snapshot`. Policies read it and return moves;
they never hold on to it or mutate it. Only counts are exposed (live runs per cell, ready groups),
not run records, so a snapshot is O(cells) to build and the same for the simulator and Ray.

Invariants: ``0 <= live_runs <= slots``; a cell outside rollout / draining has no live runs;
``step_cells`` lists exactly the cells whose ``step`` is the step in progress.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class Role(str, Enum):
    """What a cell does now (docs/design.md, terms)."""

    ROLLOUT = "rollout"
    DRAINING = "draining"
    TRAINING = "training"
    SYNCING = "syncing"


@dataclass(frozen=True, slots=True)
class SchedulingConfig:
    """The job a policy schedules: batch shape, length and the staleness bound."""

    total_steps: int
    """Optimizer steps to run (the paper's job: 48)."""
    batch_groups: int
    """Groups per step (B)."""
    runs_per_group: int
    """Runs per group (GRPO group size G)."""
    staleness_bound: int
    """Max (step that trains a group) - (version its first run started with); >= 0."""

    def __post_init__(self) -> None:
        for name in ("total_steps", "batch_groups", "runs_per_group"):
            if getattr(self, name) < 1:
                raise ValueError(f"SchedulingConfig.{name}: must be >= 1, got {getattr(self, name)}")
        if self.staleness_bound < 0:
            raise ValueError(
                f"SchedulingConfig.staleness_bound: must be >= 0, got {self.staleness_bound}"
            )

    @property
    def total_groups(self) -> int:
        """Groups in the whole job."""
        return self.total_steps * self.batch_groups

    @property
    def total_runs(self) -> int:
        """Runs in the whole job."""
        return self.total_groups * self.runs_per_group


@dataclass(frozen=True, slots=True)
class CellState:
    """One cell at one instant."""

    cell: int
    """Index of the cell (0..cells-1)."""
    role: Role
    """Current role."""
    live_runs: int
    """Runs started on this cell that have not ended."""
    slots: int
    """Most runs the cell serves at once (KV-cache bound)."""
    step: int
    """Step the cell trains, or -1 (not training, or an idle training cell)."""
    ready_at: float
    """Time its current switch / sync ends; work in the role starts then."""
    oldest_run_start: float
    """Start time of its oldest live run, or +inf when empty."""
    newest_run_start: float = float("inf")
    """Start time of its newest live run, or +inf when empty (or not reported). Every live run
    ends by ``newest_run_start + timeout``, so this bounds when a draining cell empties."""

    @property
    def free_slots(self) -> int:
        """Slots a rollout cell could fill now."""
        return self.slots - self.live_runs

    @property
    def idle_trainer(self) -> bool:
        """A training cell not in any step."""
        return self.role is Role.TRAINING and self.step < 0


@dataclass(frozen=True, slots=True)
class ClusterState:
    """The whole cluster at one instant: what every policy decides on."""

    time: float
    """Hours since the start."""
    config: SchedulingConfig
    """The job."""
    cells: tuple[CellState, ...]
    """Every cell, by index."""
    version: int
    """Policy version = steps applied."""
    step: int
    """Step in progress, or -1."""
    step_groups: int
    """Groups the step in progress has taken (0 when none)."""
    step_starved: bool
    """The step in progress has trained everything it took and waits for groups."""
    ready_groups: int
    """Ended groups not yet taken by a step."""
    takeable_groups: int
    """Groups the next (or current) step could take right now under the staleness bound."""
    startable_runs: int
    """Runs the staleness bound lets start now (admitted groups' unstarted runs + new groups)."""
    unstarted_runs: int
    """Runs of the job not started yet."""
    live_runs: int
    """Runs in flight on all cells."""

    def with_role(self, *roles: Role) -> tuple[CellState, ...]:
        """Cells whose role is one of ``roles``."""
        return tuple(c for c in self.cells if c.role in roles)

    @property
    def done(self) -> bool:
        """Every step trained."""
        return self.version >= self.config.total_steps

    @property
    def steps_left_to_start(self) -> int:
        """Steps not begun yet."""
        return self.config.total_steps - self.version - (1 if self.step >= 0 else 0)
