"""Run identity on cells: the scheduler numbers runs ``0, 1, 2, …``; engines, records and the
spool know them by key ``"r<index>"``. :func:`run_key` / :func:`run_index` are the only places
that spell the format; :class:`RunSpec` is what a runner is asked to start.
"""

from __future__ import annotations

import dataclasses


def run_key(index: int) -> str:
    """The run id of scheduler run ``index`` (``run_key(7) == "r7"``)."""
    return f"r{index}"


def run_index(key: str) -> int:
    """The scheduler index of run id ``key`` (inverse of :func:`run_key`).

    Raises:
        ValueError: ``key`` is not ``"r<int>"`` (names the key).
    """
    if not key.startswith("r") or not key[1:].isdigit():
        raise ValueError(f"run_index: run id {key!r} is not of the form 'r<index>'")
    return int(key[1:])


def group_key(index: int) -> str:
    """The group id of scheduler group ``index`` (``group_key(3) == "g3"``)."""
    return f"g{index}"


@dataclasses.dataclass(frozen=True, slots=True)
class RunSpec:
    """One run to start."""

    task: str
    """Registered task name (``ray_xlong.rollout.tasks.TASKS``)."""
    seed: int
    """Task seed (runs of a group share it)."""
    run_id: str
    """Unique run id."""
    group_id: str
    """The run's group."""
