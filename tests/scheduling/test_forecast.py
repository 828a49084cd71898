"""Forecast policy: target from certain work, early drain of the cell that empties first,
trainers kept while work is on its way, config errors name the field."""

from __future__ import annotations

import dataclasses

import pytest

from ray_xlong.scheduling.elastic import ElasticPolicy
from ray_xlong.scheduling.forecast import ForecastPolicy
from ray_xlong.scheduling.machine import CellMachine
from ray_xlong.scheduling.moves import Drain, StartRuns, StartTraining, Sync
from ray_xlong.scheduling.state import SchedulingConfig

# 4 steps × 2 groups × 2 runs, bound 1: 2 steps (8 runs) admitted at version 0.
JOB = SchedulingConfig(total_steps=4, batch_groups=2, runs_per_group=2, staleness_bound=1)


def started(slots=(4, 4, 4), plan=((0, 4, 0.0), (1, 2, 1.0), (2, 2, 2.0))) -> CellMachine:
    """A machine with runs started per (cell, count, time)."""
    m = CellMachine(JOB, slots=list(slots))
    for cell, count, t in plan:
        m.apply(StartRuns(cell, count), t)
    return m


def test_target_counts_ready_and_live_groups_over_the_horizon():
    # 8 live runs = 4 groups; 1 group per cell-hour over a 2 h horizon -> round(4 / 2) = 2 cells.
    m = started()
    policy = ForecastPolicy(train_groups_per_cell_h=1.0, horizon_h=2.0)
    assert policy.target_trainers(m.snapshot(2.0)) == 2
    # a faster trainer (4 groups / cell-hour): 4 / 8 = 0.5 -> 1 (at least one while work is due)
    faster = dataclasses.replace(policy, train_groups_per_cell_h=4.0)
    assert faster.target_trainers(m.snapshot(2.0)) == 1


@pytest.mark.parametrize("per_h, want", [
    pytest.param(1.5, 1, id="4/3=1.33->1 (ceil would keep a 2nd, mostly idle trainer)"),
    pytest.param(1.25, 2, id="4/2.5=1.6->2"),
    pytest.param(100.0, 1, id="4/200=0.02->1 (work is due: one trainer)"),
])
def test_target_is_the_nearest_number_of_cells(per_h, want):
    # 4 groups of certain work over a 2 h horizon at per_h groups a cell-hour
    m = started()
    policy = ForecastPolicy(train_groups_per_cell_h=per_h, horizon_h=2.0)
    assert policy.target_trainers(m.snapshot(2.0)) == want


def test_drains_ahead_the_cell_whose_newest_run_is_oldest():
    # No group is ready yet: elastic waits; forecast drains now. Cell 0 holds the most runs but
    # its newest started at t=0, so it empties first (runs end within the horizon of their
    # start); fewest-live would pick cell 2 (2 runs, newest at t=2).
    m = started()
    state, event = m.snapshot(2.0), m.log[-1]
    assert not [mv for mv in ElasticPolicy().decide(state, event) if isinstance(mv, Drain)]
    moves = ForecastPolicy(train_groups_per_cell_h=4.0, horizon_h=2.0).decide(state, event)
    assert [mv for mv in moves if isinstance(mv, Drain)] == [Drain(0)]


def test_never_drains_below_min_rollout_cells():
    m = started()
    policy = ForecastPolicy(train_groups_per_cell_h=0.01, horizon_h=1.0)  # wants every cell
    moves = policy.decide(m.snapshot(2.0), m.log[-1])
    assert sorted(mv.cell for mv in moves if isinstance(mv, Drain)) == [0, 1]  # cell 2 stays


def test_an_idle_trainer_stays_while_rollout_could_not_use_it():
    # bound 0, 1 group of 2 runs admitted and started on cell 0; cell 1 trained step 0 and is
    # idle: nothing may start (startable 0), so syncing it back would only cost a sync.
    job = SchedulingConfig(total_steps=2, batch_groups=1, runs_per_group=2, staleness_bound=0)
    m = CellMachine(job, slots=[4, 4])
    m.apply(StartRuns(0, 2), 0.0)
    m.run_ended(0, 0, 1.0), m.run_ended(0, 1, 1.0)
    m.apply(StartTraining(1, 0), 1.0)
    m.take_groups()
    m.end_step(2.0)
    m.apply(StartRuns(0, 2), 2.0)  # group 1 (version 1) is live; startable is now 0
    state = m.snapshot(2.0)
    assert state.startable_runs == 0 and state.cells[1].idle_trainer
    policy = ForecastPolicy(train_groups_per_cell_h=100.0, horizon_h=1.0)  # target 1
    assert not [mv for mv in policy.decide(state, m.log[-1]) if isinstance(mv, Sync)]


@pytest.mark.parametrize("field", ["train_groups_per_cell_h", "horizon_h"])
def test_config_errors_name_the_field(field):
    kwargs = {"train_groups_per_cell_h": 1.0, "horizon_h": 1.0, field: 0.0}
    with pytest.raises(ValueError, match=f"ForecastPolicy.{field}"):
        ForecastPolicy(**kwargs)


def test_snapshot_reports_the_newest_run_start():
    m = started(plan=((0, 1, 0.0), (0, 2, 1.5)))
    cell = m.snapshot(2.0).cells[0]
    assert (cell.oldest_run_start, cell.newest_run_start) == (0.0, 1.5)
    assert m.snapshot(2.0).cells[1].newest_run_start == float("inf")  # empty


def test_horizon_grows_with_the_oldest_live_run():
    # runs started at t=0 are still live at t=5 although horizon_h is 2: runs now take longer,
    # so the same live work arrives over 5 h -> 4 groups / (1 group/cell-h · 5 h) -> 1 cell
    m = started()
    policy = ForecastPolicy(train_groups_per_cell_h=1.0, horizon_h=2.0)
    assert policy.horizon(m.snapshot(2.0)) == 2.0
    assert policy.horizon(m.snapshot(5.0)) == 5.0
    assert policy.target_trainers(m.snapshot(5.0)) == 1
    assert policy.target_trainers(m.snapshot(2.0)) == 2
