"""Cell state machine: legal transitions pass, illegal ones raise with the move and the cell."""

from __future__ import annotations

import pytest

from ray_xlong.scheduling.machine import CellMachine, TransitionError
from ray_xlong.scheduling.moves import Drain, JoinStep, Reserve, StartRuns, StartTraining, Sync
from ray_xlong.scheduling.state import Role, SchedulingConfig

# 2 steps × 1 group × 2 runs, staleness 0: run ids 0,1 = group 0 (step 0), 2,3 = group 1.
JOB = SchedulingConfig(total_steps=2, batch_groups=1, runs_per_group=2, staleness_bound=0)


def machine(cells: int = 2) -> CellMachine:
    return CellMachine(JOB, slots=[4] * cells)


def test_a_full_cycle_rollout_draining_training_syncing_rollout():
    m = machine()
    assert m.apply(StartRuns(0, 2), 0.0) == [0, 1]  # staleness 0 admits only group 0
    m.apply(Drain(0), 0.5)
    m.run_ended(0, 0, 1.0)
    assert m.run_ended(0, 1, 2.0)  # group 0 ready
    m.apply(StartTraining(0, 0), 2.0)
    assert m.take_groups() == [0]
    m.end_step(3.0)
    m.apply(Sync(0, 1), 3.0)
    assert m.role[0] is Role.SYNCING
    m.cell_ready(0, 3.5)
    assert m.role[0] is Role.ROLLOUT and m.version == 1
    roles = [e.role for e in m.log if e.kind == "role"]
    assert roles == ["draining", "training", "syncing", "rollout"]


@pytest.mark.parametrize(
    "move",
    [
        pytest.param(Drain(0), id="drain-is-fine-but-training-is-not"),
    ],
)
def test_a_cell_with_live_runs_cannot_train(move):
    m = machine()
    m.apply(StartRuns(0, 1), 0.0)
    m.apply(move, 0.0)
    for leave in (StartTraining(0, 0), Reserve(0)):
        with pytest.raises(TransitionError, match="live runs"):
            m.apply(leave, 0.1)


def test_a_run_ends_on_the_cell_that_started_it_once():
    m = machine()
    m.apply(StartRuns(0, 1), 0.0)
    with pytest.raises(TransitionError, match="not live on cell 1"):
        m.run_ended(1, 0, 1.0)
    m.run_ended(0, 0, 1.0)
    with pytest.raises(TransitionError):
        m.run_ended(0, 0, 2.0)


@pytest.mark.parametrize(
    "moves, message",
    [
        pytest.param([StartRuns(0, 5)], "free slots", id="more-runs-than-slots"),
        pytest.param([StartRuns(0, 3)], "staleness bound", id="beyond-admission"),
        pytest.param([StartTraining(1, 1)], "in order", id="step-out-of-order"),
        pytest.param([JoinStep(1, 0)], "in progress", id="join-without-step"),
        pytest.param([Reserve(1), Sync(1, 1)], "current version", id="sync-wrong-version"),
        pytest.param([StartTraining(1, 0), Sync(1, 0)], "idle trainer", id="sync-mid-step"),
        pytest.param([Drain(1), Drain(1)], "not rollout", id="drain-twice"),
    ],
)
def test_illegal_moves_raise(moves, message):
    m = machine()
    *ok, bad = moves
    for move in ok:
        m.apply(move, 0.0)
    with pytest.raises((TransitionError, ValueError), match=message):
        m.apply(bad, 0.0)


def test_step_cannot_end_before_it_holds_the_batch():
    m = machine()
    m.apply(StartTraining(1, 0), 0.0)
    with pytest.raises(TransitionError, match="holds 0 groups"):
        m.end_step(1.0)


def test_snapshot_counts():
    m = machine()
    m.apply(StartRuns(0, 2), 0.0)
    s = m.snapshot(0.0)
    assert [c.live_runs for c in s.cells] == [2, 0]
    assert s.startable_runs == 0 and s.unstarted_runs == 2 and s.live_runs == 2
    assert s.cells[0].free_slots == 2 and s.cells[0].oldest_run_start == 0.0


def test_snapshot_follows_every_change_and_survives_a_pickle_of_either_form():
    """The snapshot reuses a cell's ``CellState`` and the ledger memoises its take plan: both
    must follow each change, and a machine pickled without them (a checkpoint written before
    they existed) must resume."""
    import pickle

    from ray_xlong.scheduling.ledger import GroupLedger

    m = machine()
    m.apply(StartRuns(0, 2), 0.0)
    first = m.snapshot(0.0)
    assert m.snapshot(0.5).cells[1] is first.cells[1]          # unchanged cell: same object
    m.apply(Drain(0), 0.5)
    m.run_ended(0, 0, 1.0)
    assert m.snapshot(1.0).takeable_groups == 0
    m.run_ended(0, 1, 2.0)
    now = m.snapshot(2.0)
    assert now.cells[0].role is Role.DRAINING and now.cells[0].live_runs == 0
    assert now.takeable_groups == 1 and now.ready_groups == 1

    again = pickle.loads(pickle.dumps(m))
    assert again.snapshot(2.0) == now
    old = {k: v for k, v in vars(m).items() if k != "_cell_states"}
    ledger = GroupLedger.__new__(GroupLedger)
    ledger.__setstate__({k: v for k, v in vars(m.ledger).items() if k not in ("_rev", "_memo")})
    old["ledger"] = ledger
    resumed = CellMachine.__new__(CellMachine)
    resumed.__setstate__(old)
    assert resumed.snapshot(2.0) == now
    resumed.apply(StartTraining(0, 0), 2.0)
    assert resumed.take_groups() == [0] and resumed.snapshot(2.0).takeable_groups == 0
