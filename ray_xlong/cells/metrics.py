"""What a job on Ray cells measured, and the invariant checks read off its event log.

:class:`RayResult` mirrors the simulator's ``SimResult`` (same event-log format, per-group
staleness, busy cell-time) plus the costs only a real run has (role switches, syncs, step
finish, micro-batches). :func:`check_invariants` checks docs/design.md invariants 6, 8 and 9 on a
result: no cell left rollout with a live run, runs ended on the cell that started them,
staleness <= bound (per group and per trained token), every ended run trained exactly once.
"""

from __future__ import annotations

import collections
import dataclasses
import statistics
from typing import TYPE_CHECKING

from ray_xlong.cells.runs import run_key
from ray_xlong.scheduling import Event

if TYPE_CHECKING:
    from ray_xlong.cells.job_state import JobState
    from ray_xlong.cells.records import FaultRecord


@dataclasses.dataclass(frozen=True, slots=True)
class RayResult:
    """Outcome of one job on cells."""

    mode: str
    """Policy name."""
    makespan_s: float
    """Wall seconds until the last step ended."""
    cells: int
    """Cells in the pool."""
    slots_per_cell: int
    """Run slots of a rollout cell."""
    staleness: tuple[int, ...]
    """Per group: step that trained it - its version."""
    token_staleness_max: int
    """Max over trained tokens of (step - the version that generated it)."""
    trained_step: tuple[int, ...]
    """Per group: the step that trained it."""
    trained_runs: tuple[tuple[str, ...], ...]
    """Per step: the run ids in its batch."""
    events: tuple[Event, ...]
    """The event log (simulator format; times in seconds)."""
    timings: dict[str, tuple[float, ...]]
    """``switch_s``, ``sync_s``, ``step_finish_s``, ``micro_batch_s`` (seconds each),
    ``micro_batch_targets``, ``step_members``."""
    placement_groups_created: int
    """Placement groups created by the pool (all at start-up)."""
    faults: tuple[FaultRecord, ...] = ()
    """One record per recovery (``cells.records.FaultRecord``)."""

    @property
    def busy_cell_s(self) -> float:
        """Cell-seconds serving runs (run time ÷ slots) or training (micro-batches, and the
        step finish on every member)."""
        starts = {e.run: e.time for e in self.events if e.kind == "run_started"}
        rollout = sum(e.time - starts[e.run] for e in self.events if e.kind == "run_ended")
        t = self.timings
        finish = sum(s * m for s, m in zip(t.get("step_finish_s", ()), t.get("step_members", ())))
        return rollout / self.slots_per_cell + sum(t.get("micro_batch_s", ())) + finish

    @property
    def gpu_busy_frac(self) -> float:
        """Busy cell-time ÷ (cells × makespan)."""
        return self.busy_cell_s / (self.cells * self.makespan_s)

    def timing_summary(self) -> dict[str, float]:
        """Mean and max of each timing list (``<name>_mean`` / ``<name>_max``), and counts."""
        out: dict[str, float] = {}
        for name, values in self.timings.items():
            if values:
                out[f"{name}_mean"] = statistics.fmean(values)
                out[f"{name}_max"] = max(values)
                out[f"{name}_count"] = len(values)
        return out


def job_result(job: JobState) -> RayResult:
    """The measurements of a job so far (its machine's ledger and log, its timings, trained
    runs and recoveries)."""
    led = job.m.ledger
    return RayResult(
        mode=job.policy.name, makespan_s=job.now(), cells=len(job.cells),
        slots_per_cell=job.cfg.slots_per_cell,
        staleness=tuple(s - v for s, v in zip(led.trained_step, led.group_version)),
        token_staleness_max=job.token_staleness, trained_step=tuple(led.trained_step),
        trained_runs=tuple(tuple(job.trained.get(s, ())) for s in range(job.m.version)),
        events=tuple(job.m.log), timings={k: tuple(v) for k, v in job.stats.items()},
        placement_groups_created=job.pool.placement_groups_created,
        faults=tuple(job.faults))


def check_invariants(result: RayResult, *, staleness_bound: int) -> list[str]:
    """Violations of the cell invariants in ``result`` (empty when all hold)."""
    bad: list[str] = []
    live: dict[int, set[int]] = collections.defaultdict(set)
    role: dict[int, str] = collections.defaultdict(lambda: "rollout")
    started_on: dict[int, int] = {}
    ended: list[int] = []
    for e in result.events:
        if e.kind == "run_started":
            if role[e.cell] != "rollout":
                bad.append(f"run {e.run} started on cell {e.cell} in role {role[e.cell]}")
            live[e.cell].add(e.run)
            started_on[e.run] = e.cell
        elif e.kind == "run_restarted":  # in place, or on another cell after a retirement
            if e.run not in started_on:
                bad.append(f"run {e.run} restarted on cell {e.cell} but never started")
            live[started_on.get(e.run, e.cell)].discard(e.run)
            live[e.cell].add(e.run)
            started_on[e.run] = e.cell
        elif e.kind == "cell_retired":
            live[e.cell].clear()
        elif e.kind == "run_ended":
            if started_on.get(e.run) != e.cell:
                bad.append(f"run {e.run} ended on cell {e.cell}, started on "
                           f"{started_on.get(e.run)}")
            live[e.cell].discard(e.run)
            ended.append(e.run)
        elif e.kind == "role":
            if e.role in ("training", "syncing") and live[e.cell]:
                bad.append(f"cell {e.cell} entered {e.role} at {e.time:.3f} with live runs "
                           f"{sorted(live[e.cell])}")
            role[e.cell] = e.role
    worst = max(result.staleness, default=0)
    if worst > staleness_bound or result.token_staleness_max > staleness_bound:
        bad.append(f"staleness {worst} (groups) / {result.token_staleness_max} (tokens) "
                   f"exceeds the bound {staleness_bound}")
    trained = collections.Counter(r for step in result.trained_runs for r in step)
    want = collections.Counter(run_key(r) for r in ended)
    if trained != want:
        diff = (trained - want) + (want - trained)
        bad.append(f"ended runs not trained exactly once: {sorted(diff.items())[:10]}")
    return bad
