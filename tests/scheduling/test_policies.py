"""Policy contract: pure and deterministic; moves valid for the machine; config errors name fields."""

from __future__ import annotations

import pytest

from ray_xlong.scheduling.asynchronous import AsyncPolicy
from ray_xlong.scheduling.colocated import ColocatedPolicy
from ray_xlong.scheduling.elastic import ElasticPolicy
from ray_xlong.scheduling.forecast import ForecastPolicy
from ray_xlong.scheduling.machine import CellMachine
from ray_xlong.scheduling.moves import Reserve, StartRuns
from ray_xlong.scheduling.state import SchedulingConfig

JOB = SchedulingConfig(total_steps=2, batch_groups=2, runs_per_group=2, staleness_bound=1)
POLICIES = [ColocatedPolicy(), ColocatedPolicy(streaming=True), AsyncPolicy(rollout_cells=1),
            ElasticPolicy(), ElasticPolicy(streaming=False, joining=False),
            ForecastPolicy(train_groups_per_cell_h=1.0, horizon_h=1.0)]


@pytest.mark.parametrize("policy", POLICIES, ids=lambda p: f"{p.name}-{getattr(p, 'streaming', '')}")
def test_decide_is_pure_and_its_moves_apply(policy):
    m = CellMachine(JOB, slots=[3, 3])
    state, event = m.snapshot(0.0), m.log[-1]
    moves = policy.decide(state, event)
    assert isinstance(moves, tuple) and moves == policy.decide(state, event)
    for move in moves:
        m.apply(move, 0.0)


def test_colocated_fills_every_cell_at_start():
    # 4 groups × 2 runs admitted (bound 1 -> 2 steps ahead) = 8 runs on 2 cells × 3 slots.
    m = CellMachine(JOB, slots=[3, 3])
    assert ColocatedPolicy().decide(m.snapshot(0.0), m.log[-1]) == (StartRuns(0, 3), StartRuns(1, 3))


def test_async_reserves_its_training_pool():
    m = CellMachine(JOB, slots=[3, 3])
    assert AsyncPolicy(rollout_cells=1).decide(m.snapshot(0.0), m.log[-1]) == (StartRuns(0, 3), Reserve(1))


def test_async_needs_a_training_cell():
    with pytest.raises(ValueError, match="AsyncPolicy.rollout_cells"):
        AsyncPolicy(rollout_cells=0)
    m = CellMachine(JOB, slots=[3])
    with pytest.raises(ValueError, match="AsyncPolicy.rollout_cells"):
        AsyncPolicy(rollout_cells=1).decide(m.snapshot(0.0), m.log[-1])


def test_scheduling_config_errors_name_the_field():
    with pytest.raises(ValueError, match="SchedulingConfig.staleness_bound"):
        SchedulingConfig(total_steps=1, batch_groups=1, runs_per_group=1, staleness_bound=-1)
