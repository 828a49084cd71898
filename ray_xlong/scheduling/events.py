"""Scheduling events: the one record both actuators emit and every policy reads.

An :class:`Event` is something that *happened* at a time on a cell (a run started or ended, a
cell changed role, a step began or ended). The simulator emits them against a virtual clock; the
Ray driver (issue 5) emits the same records against the wall clock, so one timeline plot and one
set of checks serve both. Events are flat, frozen and JSON-serialisable: ``-1`` marks a field
that does not apply (a step event has no run).

Invariants: ``time`` never decreases along a log; ``kind`` is one of :data:`KINDS`.

Event log file (JSONL, :func:`to_jsonl` / :func:`from_jsonl`): one object per line with every
field of :class:`Event`, ``-1`` / ``""`` where it does not apply::

    {"time": 0.42, "kind": "run_started", "cell": 1, "run": 17, "group": 4, "step": -1,
     "version": 3, "role": ""}
    {"time": 0.97, "kind": "role", "cell": 1, "run": -1, "group": -1, "step": -1,
     "version": -1, "role": "draining"}

The time unit is the writer's: the simulator writes hours (``ray-xlong sim --events-dir``,
``bench --backend sim``), the Ray driver wall seconds since its job started
(``ray-xlong train --out`` → ``events.jsonl``, ``bench --backend ray --events-dir``; in the
time-compressed long-horizon job one second is one task hour). ``ray-xlong timeline
--time-unit`` labels the axis.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Iterable

KINDS = (
    "start",  # the clock starts; no cell
    "run_started",  # run `run` of group `group` began on `cell` with weights `version`
    "run_ended",  # that run ended on the same cell
    "role",  # `cell` entered `role` (switch / sync delays end at the matching `ready` event)
    "ready",  # `cell` finished its switch or sync and works in its role from now on
    "step_started",  # step `step` began (its first cell is `cell`)
    "step_joined",  # `cell` joined step `step` in progress
    "step_starved",  # step `step` consumed all ready work and waits for groups
    "step_ended",  # step `step` applied: policy version is now `step + 1`
    "micro_batch",  # `cell` finished a micro-batch of step `step` (simulator: its last one)
    "finish",  # every step trained; no cell
    "cell_lost",  # an actor of `cell` died (`role` says which: "runner", "learner", "node")
    "cell_retired",  # `cell` left the job (its node is gone); its live runs restart elsewhere
    "cell_rebuilt",  # a lost or retired `cell` has fresh actors and is back in its role
    "run_restarted",  # run `run` started again on `cell` (its runner or cell was lost)
    "resumed",  # a new driver resumed the job from a checkpoint at version `version`
)


@dataclass(frozen=True, slots=True)
class Event:
    """One thing that happened; the input of a policy and one line of the event log."""

    time: float
    """Time since the start of the job: hours (simulator) or wall seconds (Ray driver)."""
    kind: str
    """One of :data:`KINDS`."""
    cell: int = -1
    """Cell index, or -1 for cluster-wide events."""
    run: int = -1
    """Run id (``run_started`` / ``run_ended``), else -1."""
    group: int = -1
    """Group id of ``run``, else -1."""
    step: int = -1
    """Step index (``step_*``), else -1."""
    version: int = -1
    """Policy version of the weights involved (run start, step end), else -1."""
    role: str = ""
    """New role for ``role`` events, else empty."""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"Event.kind: unknown kind {self.kind!r}; expected one of {KINDS}")
        if self.time < 0:
            raise ValueError(f"Event.time: must be >= 0, got {self.time}")


def to_jsonl(events: Iterable[Event]) -> str:
    """Serialise events, one JSON object per line (fields as in :class:`Event`)."""
    return "".join(json.dumps(dataclasses.asdict(e), separators=(",", ":")) + "\n" for e in events)


def from_jsonl(text: str) -> list[Event]:
    """Parse :func:`to_jsonl` output back into events (blank lines are skipped)."""
    return [Event(**json.loads(line)) for line in text.splitlines() if line.strip()]
