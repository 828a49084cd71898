"""Simulator properties over random small workloads, for every mode.

Checked from the event log (the same checks can run on a Ray driver's log): every run starts
once and ends once on its cell, no cell leaves rollout with live runs, every group is trained
exactly once with staleness <= bound, the run is deterministic per seed, makespan >= the bound.
"""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ray_xlong.scheduling.asynchronous import AsyncPolicy
from ray_xlong.scheduling.colocated import ColocatedPolicy
from ray_xlong.scheduling.elastic import ElasticPolicy
from ray_xlong.scheduling.forecast import ForecastPolicy
from ray_xlong.scheduling.online import OnlineForecastPolicy
from ray_xlong.scheduling.state import SchedulingConfig
from ray_xlong.sim.cluster import ClusterConfig, CostConfig
from ray_xlong.sim.metrics import bound_parts, lower_bound_h
from ray_xlong.sim.simulator import simulate
from ray_xlong.sim.workload import Workload, WorkloadConfig, sample_workload

MODES = {
    "colocated": lambda cells: ColocatedPolicy(),
    "colocated+streaming": lambda cells: ColocatedPolicy(streaming=True),
    "async": lambda cells: AsyncPolicy(rollout_cells=max(1, cells // 2)),
    "async+streaming": lambda cells: AsyncPolicy(rollout_cells=cells - 1, streaming=True),
    "elastic": lambda cells: ElasticPolicy(),
    "elastic-no-streaming": lambda cells: ElasticPolicy(streaming=False, joining=False),
    # any estimates must keep the invariants: eager (big targets) and lazy (small targets)
    "forecast-eager": lambda cells: ForecastPolicy(train_groups_per_cell_h=0.1, horizon_h=1.0),
    "forecast-lazy": lambda cells: ForecastPolicy(train_groups_per_cell_h=10.0, horizon_h=6.0),
    "forecast-online": lambda cells: OnlineForecastPolicy(),
}


@st.composite
def setups(draw):
    job = SchedulingConfig(
        total_steps=draw(st.integers(1, 4)), batch_groups=draw(st.integers(1, 3)),
        runs_per_group=draw(st.integers(1, 3)), staleness_bound=draw(st.integers(0, 3)),
    )
    wl = WorkloadConfig(
        median_run_h=draw(st.floats(0.2, 3.0)), sigma=draw(st.floats(0.0, 1.5)),
        timeout_h=draw(st.floats(1.0, 6.0)), tokens_per_run_h=1e5,
        task_corr=draw(st.floats(0.0, 1.0)), failure_rate=draw(st.sampled_from([0.0, 0.1])),
    )
    cells = draw(st.integers(2, 4))
    cluster = ClusterConfig(cells=cells, nodes_per_cell=1, gpus_per_node=8,
                            slots_per_cell=draw(st.integers(1, 4)))
    costs = CostConfig(train_tokens_per_cell_h=draw(st.floats(1e4, 1e6)), step_fixed_h=0.05,
                       to_train_h=draw(st.floats(0.0, 0.2)), sync_h=draw(st.floats(0.0, 0.3)))
    seed = draw(st.integers(0, 2**16))
    w = sample_workload(wl, runs=job.total_runs, group_size=job.runs_per_group, seed=seed)
    return job, w, cluster, costs


def check_log(result, job, costs=None):
    live: dict[int, set[int]] = {}
    syncing: dict[int, float] = {}
    started, ended = set(), set()
    for e in result.events:
        if e.kind == "run_started":
            assert e.run not in started
            started.add(e.run)
            live.setdefault(e.cell, set()).add(e.run)
        elif e.kind == "run_ended":
            assert e.run in live.get(e.cell, set()), f"run {e.run} ended off its cell"
            live[e.cell].remove(e.run)
            ended.add(e.run)
        elif e.kind == "role" and e.role in ("training", "syncing"):
            assert not live.get(e.cell), f"cell {e.cell} left rollout with live runs"
            if e.role == "syncing":
                syncing[e.cell] = e.time
        elif e.kind == "role" and e.role == "rollout" and e.cell in syncing and costs is not None:
            took = e.time - syncing.pop(e.cell)
            assert took >= costs.sync_h - 1e-9, f"cell {e.cell} synced in {took} < sync_h"
    assert started >= ended
    times = [e.time for e in result.events]
    assert times == sorted(times)


@settings(max_examples=25, deadline=None)
@given(setup=setups(), mode=st.sampled_from(sorted(MODES)))
def test_invariants_hold_for_every_mode(setup, mode):
    job, w, cluster, costs = setup
    policy = MODES[mode](cluster.cells)
    result = simulate(policy, workload=w, cluster=cluster, costs=costs, config=job)
    check_log(result, job, costs)
    # every ended group trained exactly once, each step B groups, staleness within the bound
    assert sorted(result.trained_step) == [s for s in range(job.total_steps) for _ in range(job.batch_groups)]
    assert all(0 <= s <= job.staleness_bound for s in result.staleness)
    lb = lower_bound_h(workload=w, cluster=cluster, costs=costs, config=job)
    assert result.makespan_h >= lb - 1e-9
    assert -1e-9 <= result.gpu_idle_frac <= 1.0 + 1e-9  # fp: a fully busy run may read -2e-16


@settings(max_examples=10, deadline=None)
@given(setup=setups(), mode=st.sampled_from(sorted(MODES)))
def test_deterministic_per_seed(setup, mode):
    job, w, cluster, costs = setup
    a = simulate(MODES[mode](cluster.cells), workload=w, cluster=cluster, costs=costs, config=job)
    b = simulate(MODES[mode](cluster.cells), workload=w, cluster=cluster, costs=costs, config=job)
    assert a.events == b.events and a.makespan_h == b.makespan_h


@settings(max_examples=15, deadline=None)
@given(
    steps=st.integers(1, 4), bound=st.integers(0, 2), cells=st.integers(2, 4),
    duration=st.floats(0.5, 4.0), switch=st.floats(0.0, 0.2),
)
def test_identical_runs_without_tail_elastic_matches_colocated(steps, bound, cells, duration, switch):
    """No tail, every run the same: elastic cannot win, and loses at most the switch overheads."""
    job = SchedulingConfig(total_steps=steps, batch_groups=cells, runs_per_group=2, staleness_bound=bound)
    wl = WorkloadConfig(median_run_h=duration, sigma=0.0, timeout_h=10.0, tokens_per_run_h=1e5)
    w = sample_workload(wl, runs=job.total_runs, group_size=2, seed=0)
    # slots hold one round of runs: every round starts at once and ends at once
    cluster = ClusterConfig(cells=cells, nodes_per_cell=1, gpus_per_node=8,
                            slots_per_cell=2 * (bound + 1))
    costs = CostConfig(train_tokens_per_cell_h=1e6, step_fixed_h=0.01, to_train_h=switch, sync_h=switch)
    col = simulate(ColocatedPolicy(), workload=w, cluster=cluster, costs=costs, config=job).makespan_h
    ela = simulate(ElasticPolicy(), workload=w, cluster=cluster, costs=costs, config=job).makespan_h
    train_h = sum(w.tokens) / costs.train_tokens_per_cell_h  # all training on a single cell
    overhead = steps * (2 * switch + costs.step_fixed_h) + train_h
    assert abs(ela - col) <= overhead + 1e-9


def test_a_superseded_switch_does_not_cut_a_sync_short():
    """Regression: a cell joins a step (switch ready at t + to_train), the step ends first, the
    cell syncs (ready at t' + sync_h). The switch's stale "ready" event used to flip the syncing
    cell back to rollout early, skipping part of the sync. Found by a random search (seed 253)."""
    job = SchedulingConfig(total_steps=4, batch_groups=2, runs_per_group=1, staleness_bound=1)
    wl = WorkloadConfig(median_run_h=0.3771643700175359, sigma=0.6690351523020179,
                        timeout_h=1.7236668571805742, tokens_per_run_h=1e5)
    w = sample_workload(wl, runs=job.total_runs, group_size=1, seed=253)
    cluster = ClusterConfig(cells=3, nodes_per_cell=1, gpus_per_node=8, slots_per_cell=3)
    costs = CostConfig(train_tokens_per_cell_h=724376.3069266975, step_fixed_h=0.05,
                       to_train_h=0.14408613446213697, sync_h=0.09521920955540553)
    result = simulate(ElasticPolicy(), workload=w, cluster=cluster, costs=costs, config=job)
    check_log(result, job, costs)
    # each role entry after a superseded switch is logged once: rollout follows syncing only
    back = [e for e in result.events if e.kind == "role" and e.role == "rollout"]
    assert len(back) == sum(1 for e in result.events if e.kind == "role" and e.role == "syncing")


def test_lower_bound_counts_the_fixed_step_cost_as_cell_time():
    """The fixed step cost blocks the next update, not the rollout cells. Async (1 rollout cell,
    1 trainer), 4 steps of one 1 h run, fixed cost 1 h: runs end at 1, 2, 3, 4 h and the steps at
    ~2, 3, 4, 5 h. The old bound (R + T) / cells + steps × fixed = (4 + 0.04) / 2 + 4 = 6.02 h
    exceeded that real schedule; the bound is now max((4 + 0.04 + 4) / 2, 1 + 0.005 + 1, 1 + 4)
    = 5 h."""
    job = SchedulingConfig(total_steps=4, batch_groups=1, runs_per_group=1, staleness_bound=3)
    cluster = ClusterConfig(cells=2, nodes_per_cell=1, gpus_per_node=1, slots_per_cell=1)
    costs = CostConfig(train_tokens_per_cell_h=100, step_fixed_h=1, to_train_h=0, sync_h=0)
    w = _unit_workload(4, 1)
    result = simulate(AsyncPolicy(rollout_cells=1), workload=w, cluster=cluster, costs=costs, config=job)
    lb = lower_bound_h(workload=w, cluster=cluster, costs=costs, config=job)
    assert result.makespan_h == pytest.approx(5.04)
    assert lb == pytest.approx(5.0) and result.makespan_h >= lb


def test_a_policy_that_waits_for_nothing_is_reported():
    from ray_xlong.sim.simulator import SimulationStalled

    class Idle:
        name = "idle"

        def decide(self, state, event):
            return ()

    job = SchedulingConfig(total_steps=1, batch_groups=1, runs_per_group=1, staleness_bound=0)
    with pytest.raises(SimulationStalled, match="idle"):
        simulate(Idle(), workload=_unit_workload(1, 1), config=job, **_unit_cluster())


def test_workload_size_must_match_the_job():
    job = SchedulingConfig(total_steps=1, batch_groups=1, runs_per_group=2, staleness_bound=0)
    w = _unit_workload(4, 2)
    with pytest.raises(ValueError, match="simulate.workload"):
        simulate(ColocatedPolicy(), workload=w, config=job, **_unit_cluster())
    assert dataclasses.is_dataclass(w)


def _unit_workload(runs, group_size):
    cfg = WorkloadConfig(median_run_h=1, sigma=0, timeout_h=2, tokens_per_run_h=1)
    return sample_workload(cfg, runs=runs, group_size=group_size, seed=0)


def _unit_cluster():
    return {
        "cluster": ClusterConfig(cells=2, nodes_per_cell=1, gpus_per_node=1, slots_per_cell=1),
        "costs": CostConfig(train_tokens_per_cell_h=1, step_fixed_h=0, to_train_h=0, sync_h=0),
    }


def test_role_switches_count_entering_training_and_syncing_per_cell():
    from ray_xlong.scheduling.events import Event
    from ray_xlong.sim.metrics import role_switches

    # cell 0: drain -> train -> sync -> rollout = 2 switches; cell 1 only ran runs; cell 2
    # trained from a reserve (1 switch)
    log = [Event(0.0, "run_started", cell=1, run=0, group=0),
           Event(1.0, "role", cell=0, role="draining"), Event(2.0, "role", cell=0, role="training"),
           Event(3.0, "role", cell=0, role="syncing"), Event(4.0, "role", cell=0, role="rollout"),
           Event(0.0, "role", cell=2, role="training")]
    assert role_switches(log) == {0: 2, 1: 0, 2: 1}


def test_parallel_training_cap_slows_training_on_many_cells():
    # colocated, 4 cells, 1 step of 4 groups: training work 4 cell-h; uncapped 4 cells train it
    # in 1 h, capped at 2 cells it takes 2 h (the rollout part is the same)
    import dataclasses

    from ray_xlong.scheduling.colocated import ColocatedPolicy
    from ray_xlong.sim.cluster import ClusterConfig, CostConfig
    from ray_xlong.sim.simulator import simulate
    from ray_xlong.sim.workload import WorkloadConfig, sample_workload
    from ray_xlong.scheduling.state import SchedulingConfig

    job = SchedulingConfig(total_steps=1, batch_groups=4, runs_per_group=1, staleness_bound=0)
    w = sample_workload(WorkloadConfig(median_run_h=1, sigma=0, timeout_h=2, tokens_per_run_h=1),
                        runs=4, group_size=1, seed=0)
    costs = CostConfig(train_tokens_per_cell_h=1.0, step_fixed_h=0.0, to_train_h=0.0, sync_h=0.0)
    cluster = ClusterConfig(cells=4, nodes_per_cell=1, gpus_per_node=1, slots_per_cell=1)
    free = simulate(ColocatedPolicy(), workload=w, cluster=cluster, costs=costs, config=job)
    capped = simulate(ColocatedPolicy(), workload=w, cluster=cluster, config=job,
                      costs=dataclasses.replace(costs, parallel_training_cells=2.0))
    assert free.makespan_h == pytest.approx(2.0) and capped.makespan_h == pytest.approx(3.0)
    with pytest.raises(ValueError, match="CostConfig.parallel_training_cells"):
        dataclasses.replace(costs, parallel_training_cells=0.5)


@pytest.mark.parametrize("blocks, seen_at, makespan", [
    pytest.param(False, 1.5, 3.0, id="free: run 1 seen when it ends"),
    pytest.param(True, 2.0, 3.0, id="blocking: seen when step 0's finish (1.0-2.0) ends"),
])
def test_a_blocking_step_finish_delays_what_happens_during_it(blocks, seen_at, makespan):
    # async 1 rollout / 1 training cell, 2 steps of one 1-run group, bound 1 (both admitted at
    # t=0); runs take 1.0 h and 1.5 h, training is free, a step's fixed cost is 1 h: step 0
    # finishes over 1.0-2.0, when run 1 ends (1.5). The Ray driver sees it only at 2.0; step 1
    # starts at 2.0 either way (after step 0), so both end at 3.0.
    from ray_xlong.sim.workload import Workload

    job = SchedulingConfig(total_steps=2, batch_groups=1, runs_per_group=1, staleness_bound=1)
    w = Workload((1.0, 1.5), (1e-9, 1e-9), 1)
    costs = CostConfig(train_tokens_per_cell_h=1.0, step_fixed_h=1.0, to_train_h=0.0,
                       sync_h=0.0, finish_blocks=blocks)
    cluster = ClusterConfig(cells=2, nodes_per_cell=1, gpus_per_node=1, slots_per_cell=2)
    r = simulate(AsyncPolicy(rollout_cells=1), workload=w, cluster=cluster, costs=costs,
                 config=job)
    assert [e.time for e in r.events if e.kind == "run_ended" and e.run == 1] == [seen_at]
    assert r.makespan_h == pytest.approx(makespan)


def test_lower_bound_holds_the_staleness_admission_limit():
    # bound 0, 1 group a step: one group in flight at a time, so the runs' group maxima add up
    # however many cells there are (the work bound alone would shrink with cells)
    job = SchedulingConfig(total_steps=3, batch_groups=1, runs_per_group=2, staleness_bound=0)
    w = Workload((1.0, 2.0, 3.0, 1.0, 0.5, 0.5), (1.0,) * 6, 2)
    costs = CostConfig(train_tokens_per_cell_h=1e6, step_fixed_h=0.0, to_train_h=0.0, sync_h=0.0)
    cluster = ClusterConfig(cells=16, nodes_per_cell=1, gpus_per_node=1, slots_per_cell=8)
    parts = bound_parts(workload=w, cluster=cluster, costs=costs, config=job)
    assert parts["admission"] == pytest.approx(2.0 + 3.0 + 0.5)
    result = simulate(ElasticPolicy(), workload=w, cluster=cluster, costs=costs, config=job)
    assert result.makespan_h >= lower_bound_h(workload=w, cluster=cluster, costs=costs,
                                              config=job) == pytest.approx(5.5)
