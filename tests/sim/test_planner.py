"""The planned policy: it plans from learned estimates, follows the best candidate, takes over
from any plan mid-job without breaking a rule, and its plans are recorded with their cost."""

from __future__ import annotations

import dataclasses

import pytest

from ray_xlong.scheduling.asynchronous import AsyncPolicy
from ray_xlong.scheduling.colocated import ColocatedPolicy
from ray_xlong.scheduling.elastic import ElasticPolicy
from ray_xlong.scheduling.forecast import ForecastPolicy
from ray_xlong.scheduling.state import SchedulingConfig
from ray_xlong.sim.cluster import ClusterConfig, CostConfig
from ray_xlong.sim.planner import PlannedPolicy, planned_policy
from ray_xlong.sim.simulator import simulate
from ray_xlong.sim.workload import WorkloadConfig, sample_workload

JOB = SchedulingConfig(total_steps=10, batch_groups=8, runs_per_group=4, staleness_bound=3)
COSTS = CostConfig(train_tokens_per_cell_h=2e4, step_fixed_h=0.05, to_train_h=0.1, sync_h=0.2)
WORK = sample_workload(WorkloadConfig(median_run_h=2.0, sigma=0.8, timeout_h=4.0,
                                      tokens_per_run_h=1000.0),
                       runs=JOB.total_runs, group_size=4, seed=1)


def run(policy, cells: int = 4):
    return simulate(policy, workload=WORK, cluster=ClusterConfig(cells, 1, 1, 16), costs=COSTS,
                    config=JOB)


class Rotating:
    """Follows a different plan at every step boundary (the planner's worst case)."""

    name = "rotating"

    def __init__(self):
        self.plans = [ColocatedPolicy(), AsyncPolicy(rollout_cells=2), ElasticPolicy(),
                      ForecastPolicy(train_groups_per_cell_h=2.0, horizon_h=4.0),
                      AsyncPolicy(rollout_cells=1), ColocatedPolicy(streaming=True)]

    def decide(self, state, event):
        return self.plans[state.version % len(self.plans)].decide(state, event)


def test_any_plan_takes_over_from_any_other_mid_job():
    # every move still goes through the cell machine: no live run interrupted, staleness kept
    result = run(Rotating())
    assert len(set(result.trained_step)) == JOB.total_steps
    assert max(result.staleness) <= JOB.staleness_bound


@pytest.fixture(scope="module")
def planned():
    policy = planned_policy()
    return policy, run(policy)


def test_plans_from_learned_estimates_and_records_each_plan(planned):
    policy, result = planned
    assert policy.plans, "a plan after the first step"
    first = policy.plans[0]
    assert first.version >= 1 and first.wall_s > 0
    assert {"colocated", "elastic", "split(1/3)", "split(3/1)"} <= set(first.predicted)
    assert any(label.startswith("forecast") for label in first.predicted)
    assert first.chosen == min(first.predicted, key=first.predicted.get)
    # re-plans only at step boundaries, at most one per step
    assert len({p.version for p in policy.plans}) == len(policy.plans)
    assert len(set(result.trained_step)) == JOB.total_steps


def test_planned_is_no_worse_than_the_baselines_on_a_small_job(planned):
    hours = {name: run(p).makespan_h for name, p in {
        "colocated": ColocatedPolicy(), "elastic": ElasticPolicy(),
        **{f"split{r}": AsyncPolicy(rollout_cells=r) for r in (1, 2, 3)}}.items()}
    makespan = planned[1].makespan_h
    assert makespan <= min(hours.values()) * 1.1, (makespan, hours)


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match="PlannedPolicy.replan_steps"):
        PlannedPolicy(replan_steps=0)
    assert dataclasses.replace(planned_policy(), seed=3).seed == 3
