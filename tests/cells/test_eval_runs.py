"""``EvalRuns`` (``cells/eval_runs.py``), without Ray: every evaluation run is queued, live on
one cell, or ended once; a preempted or lost run starts again; a closed round takes no more."""

from __future__ import annotations

from ray_xlong.cells.eval_runs import EvalOutcome, EvalReport, EvalRuns
from ray_xlong.cells.runs import RunSpec


def specs(round_: int, n: int) -> list[RunSpec]:
    return [RunSpec("lookup", 7, f"e{round_}-{i}-0", f"eval{round_}-{i}") for i in range(n)]


def outcome(spec: RunSpec, cell: int, reward: float = 1.0) -> EvalOutcome:
    return EvalOutcome(spec.run_id, spec.group_id, reward, cell, version=3)


def test_runs_are_placed_once_and_a_round_is_done_when_all_ended():
    ev, runner = EvalRuns(), object()
    ev.submit(0, specs(0, 3))
    a = ev.take_queued(0, room=2)                         # cell 0 has room for 2
    ev.placed(0, a, runner=runner, role="rollout")
    b = ev.take_queued(1, room=5)                         # the last one
    ev.placed(1, b, runner=runner, role="rollout")
    assert [s.run_id for s in a + b] == ["e0-0-0", "e0-1-0", "e0-2-0"] and not ev.queue
    assert (ev.live_on(0), ev.live_on(1)) == (2, 1)
    ev.report(0, EvalReport(ended=(outcome(a[0], 0), outcome(a[1], 0))))
    assert not ev.done(0)
    ev.report(1, EvalReport(ended=(outcome(b[0], 1),)))
    ev.report(1, EvalReport(ended=(outcome(b[0], 1),)))   # reported twice: counted once
    assert ev.done(0) and [o.cell for o in ev.close(0)] == [0, 0, 1]
    assert [(p.run_id, p.cell, p.role) for p in ev.placements] == [
        ("e0-0-0", 0, "rollout"), ("e0-1-0", 0, "rollout"), ("e0-2-0", 1, "rollout")]


def test_preempted_and_lost_runs_are_queued_again_first():
    ev = EvalRuns()
    ev.submit(0, specs(0, 3))
    placed = ev.take_queued(0, room=3)
    ev.placed(0, placed, runner="old", role="rollout")
    ev.report(0, EvalReport(preempted=("e0-1-0",)))       # the cell left rollout
    assert [s.run_id for s in ev.queue] == ["e0-1-0"] and ev.preempted == 1
    assert ev.lost(0) == 2                                # its runner was replaced
    assert sorted(s.run_id for s in ev.queue) == ["e0-0-0", "e0-1-0", "e0-2-0"]
    assert ev.live_on(0) == 0 and not ev.done(0)


def test_a_closed_round_drops_late_outcomes_and_its_queued_runs():
    ev = EvalRuns()
    ev.submit(0, specs(0, 2))
    ev.submit(1, specs(1, 1))
    first = ev.take_queued(0, room=1)
    ev.placed(0, first, runner="r", role="rollout")
    assert ev.close(0) == []                              # timed out: nothing ended
    assert [s.run_id for s in ev.queue] == ["e1-0-0"]     # round 0's queued run is gone
    ev.report(0, EvalReport(ended=(outcome(first[0], 0),)))
    assert ev.close(0) == [] and len(ev.ended) == 1       # seen, but its round was closed


def test_a_round_is_submitted_once():
    import pytest

    ev = EvalRuns()
    ev.submit(0, specs(0, 1))
    with pytest.raises(ValueError, match="round 0"):
        ev.submit(0, specs(0, 1))
