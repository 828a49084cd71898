"""Group ledger: admission and selection keep every group within the staleness bound."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from ray_xlong.scheduling.ledger import GroupLedger
from ray_xlong.scheduling.state import SchedulingConfig


def test_admission_lets_rollout_run_bound_steps_ahead():
    # B=2 groups/step, G=1, bound 1: at version 0, (0+1+1)*2 = 4 groups may start.
    led = GroupLedger(SchedulingConfig(total_steps=3, batch_groups=2, runs_per_group=1, staleness_bound=1))
    assert led.startable_runs(0) == 4
    assert led.start_runs(4, 0) == [0, 1, 2, 3]
    assert led.startable_runs(0) == 0 and led.startable_runs(1) == 2


def test_a_step_keeps_room_for_a_mandatory_group_still_running():
    # bound 0, B=2: groups 0,1 start at version 0; only group 1 ended -> step 0 may take it but
    # not more (group 0 is mandatory for step 0 and still running).
    led = GroupLedger(SchedulingConfig(total_steps=2, batch_groups=2, runs_per_group=1, staleness_bound=0))
    led.start_runs(2, 0)
    led.run_ended(1)
    assert led.takeable(0, 0) == 1
    assert led.take(0, 0) == [1]
    assert led.takeable(0, 1) == 0
    led.run_ended(0)
    assert led.take(0, 1) == [0]


@settings(max_examples=60, deadline=None)
@given(
    bound=st.integers(0, 3), batch=st.integers(1, 3), steps=st.integers(1, 5),
    data=st.data(),
)
def test_random_completion_orders_never_break_the_bound(bound, batch, steps, data):
    """Start what admission allows, end runs in a random order, train greedily: every group is
    trained exactly once, within the bound (take() raises otherwise)."""
    cfg = SchedulingConfig(total_steps=steps, batch_groups=batch, runs_per_group=1, staleness_bound=bound)
    led = GroupLedger(cfg)
    version, taken, running = 0, 0, []
    while version < steps:
        running += led.start_runs(led.startable_runs(version), version)
        if running:
            run = running.pop(data.draw(st.integers(0, len(running) - 1)))
            led.run_ended(run)
        taken += len(led.take(version, taken))
        if taken == batch:
            version, taken = version + 1, 0
        else:
            assert running, "stalled: nothing running and the step is not full"
    assert all(0 <= s - v <= bound for s, v in zip(led.trained_step, led.group_version))
    assert sorted(led.trained_step) == [s for s in range(steps) for _ in range(batch)]
