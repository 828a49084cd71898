"""Cell machine under faults: a retired cell leaves the snapshot and its live runs restart
elsewhere with their own ids; in-place restarts keep the cell; a pickled machine resumes at a
step boundary with every cell back in rollout and its live runs owed."""

from __future__ import annotations

import pickle

import pytest

from ray_xlong.scheduling import ElasticPolicy
from ray_xlong.scheduling.machine import CellMachine, TransitionError
from ray_xlong.scheduling.moves import StartRuns, StartTraining
from ray_xlong.scheduling.state import Role, SchedulingConfig

JOB = SchedulingConfig(total_steps=2, batch_groups=1, runs_per_group=2, staleness_bound=1)


def test_retired_cell_leaves_the_snapshot_and_its_runs_restart_elsewhere():
    m = CellMachine(JOB, slots=[2, 2, 2])
    assert m.apply(StartRuns(0, 2), 0.0) == [0, 1]
    assert m.apply(StartRuns(1, 1), 0.0) == [2]
    assert m.retire_cell(0, 1.0) == [0, 1]
    snap = m.snapshot(1.0)
    assert [c.cell for c in snap.cells] == [1, 2]
    assert snap.live_runs == 1 and snap.startable_runs >= 2
    with pytest.raises(TransitionError, match="retired"):
        m.apply(StartRuns(0, 1), 1.0)
    # The orphans start first, with their own ids, on another cell.
    assert m.apply(StartRuns(2, 2), 1.5) == [0, 1]
    kinds = [(e.kind, e.run) for e in m.log if e.run in (0, 1)]
    assert kinds[-2:] == [("run_restarted", 0), ("run_restarted", 1)]
    assert m.run_cell[0] == 2
    m.run_ended(2, 0, 2.0)
    assert m.run_ended(2, 1, 2.0)  # group 0 ready, once
    assert m.retire_cell(1, 2.0) == [2]
    with pytest.raises(TransitionError, match="last cell"):
        m.retire_cell(2, 2.0)


def test_rebuilt_cell_returns_in_rollout():
    m = CellMachine(JOB, slots=[2, 2])
    m.retire_cell(1, 0.5)
    m.rebuild_cell(1, 2.0)
    assert 1 in [c.cell for c in m.snapshot(2.0).cells] and m.role[1] is Role.ROLLOUT
    with pytest.raises(TransitionError, match="not retired"):
        m.rebuild_cell(1, 2.0)


def test_restart_in_place_keeps_the_run_on_its_cell():
    m = CellMachine(JOB, slots=[2, 2])
    m.apply(StartRuns(1, 2), 0.0)
    m.restart_run(1, 0, 3.0)
    assert m.run_cell[0] == 1 and m.live[1][0] == 3.0
    with pytest.raises(TransitionError, match="not live"):
        m.restart_run(0, 1, 3.0)


def test_pickled_machine_resumes_at_a_step_boundary():
    m = CellMachine(JOB, slots=[2, 2])
    policy = ElasticPolicy()
    m.apply(StartRuns(0, 2), 0.0)
    m.apply(StartRuns(1, 2), 0.0)
    m.run_ended(0, 0, 1.0)
    m.run_ended(0, 1, 1.0)
    m.apply(StartTraining(0, 0), 1.0)
    with pytest.raises(TransitionError, match="step boundary"):
        pickle.loads(pickle.dumps(m)).resume(1.5)
    m.take_groups()
    m.end_step(2.0)
    saved = pickle.loads(pickle.dumps(m))
    owed = saved.resume(5.0)
    assert owed == [(1, 2), (1, 3)]
    assert saved.role == [Role.ROLLOUT, Role.ROLLOUT] and saved.version == 1
    assert saved.log[-1].kind == "role" and any(e.kind == "resumed" for e in saved.log)
    assert policy.decide(saved.snapshot(5.0), saved.log[-1]) is not None


def test_elastic_drains_a_cell_for_a_step_that_lost_every_member():
    m = CellMachine(JOB, slots=[2, 2])
    policy = ElasticPolicy()
    m.apply(StartRuns(0, 2), 0.0)
    m.apply(StartRuns(1, 2), 0.0)
    m.run_ended(0, 0, 1.0)
    m.run_ended(0, 1, 1.0)
    m.apply(StartTraining(0, 0), 1.0)
    m.take_groups()
    m.retire_cell(0, 1.5)  # the step's only member is gone; cell 1 is the last rollout cell
    moves = policy.decide(m.snapshot(1.5), m.log[-1])
    assert [type(mv).__name__ for mv in moves] == ["Drain"] and moves[0].cell == 1
