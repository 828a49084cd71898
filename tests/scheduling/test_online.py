"""Online forecast: elastic until a step ended, then forecast with the learned inputs; the
registry's ``forecast`` without inputs is the online one."""

from __future__ import annotations

import pytest

from ray_xlong.scheduling.elastic import ElasticPolicy
from ray_xlong.scheduling.events import Event
from ray_xlong.scheduling.forecast import ForecastPolicy
from ray_xlong.scheduling.machine import CellMachine
from ray_xlong.scheduling.modes import CELL_MODES, ModeInputs, make_policy
from ray_xlong.scheduling.moves import StartRuns
from ray_xlong.scheduling.online import OnlineForecastPolicy
from ray_xlong.scheduling.state import SchedulingConfig

JOB = SchedulingConfig(total_steps=4, batch_groups=2, runs_per_group=2, staleness_bound=1)


def machine() -> CellMachine:
    m = CellMachine(JOB, slots=[4, 4, 4])
    m.apply(StartRuns(0, 4), 0.0)
    m.apply(StartRuns(1, 2), 1.0)
    m.apply(StartRuns(2, 2), 2.0)
    return m


def test_runs_as_elastic_until_a_step_ended_then_as_forecast_with_learned_inputs():
    m, policy = machine(), OnlineForecastPolicy()
    policy.observe(m.log)
    state, event = m.snapshot(2.0), m.log[-1]
    assert policy.inputs(state) is None
    assert policy.decide(state, event) == ElasticPolicy().decide(state, event)
    # a step of 2 groups trained on one cell for 1.5 h; the longest run seen lasted 3 h
    policy.observe([Event(2.0, "step_started", cell=2, step=0),
                    Event(3.5, "step_ended", step=0, version=1),
                    Event(3.5, "run_ended", cell=0, run=0, group=0)])
    per_h, horizon = policy.inputs(state)
    assert per_h == pytest.approx(2 / 1.5) and horizon == pytest.approx(3.5)
    want = ForecastPolicy(train_groups_per_cell_h=per_h, horizon_h=horizon,
                          name="forecast_online").decide(state, event)
    assert policy.decide(state, event) == want


def test_the_registry_forecast_learns_online_when_given_no_inputs():
    assert "forecast" in CELL_MODES and "planned" in CELL_MODES
    assert isinstance(make_policy("forecast"), OnlineForecastPolicy)
    assert make_policy("forecast").name == "forecast"
    calibrated = make_policy("forecast", ModeInputs(train_groups_per_cell_h=1.0, horizon_h=2.0))
    assert isinstance(calibrated, ForecastPolicy)
    with pytest.raises(ValueError, match="both train_groups_per_cell_h and horizon_h"):
        make_policy("forecast", ModeInputs(horizon_h=2.0))
    with pytest.raises(ValueError, match="ModeInputs.planner"):
        make_policy("planned")
    with pytest.raises(ValueError, match="OnlineForecastPolicy.min_steps"):
        OnlineForecastPolicy(min_steps=0)


def test_a_learning_policy_sees_every_event_once_through_the_settle_loop():
    seen = []

    class Recorder:
        name = "recorder"

        def observe(self, events):
            seen.extend(events)

        def decide(self, state, event):
            return ()

    m = machine()
    m.settle(Recorder(), lambda: 2.0, apply=lambda *a: None, after_round=lambda: None,
             max_rounds=2)
    m.run_ended(0, 0, 3.0)
    m.settle(Recorder(), lambda: 3.0, apply=lambda *a: None, after_round=lambda: None,
             max_rounds=2)
    assert seen == m.log
