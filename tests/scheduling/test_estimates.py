"""EventEstimator: censored run lengths, training cell-time per group, switch / sync / finish
costs, each from hand-made event logs with known answers."""

from __future__ import annotations

import pytest

from ray_xlong.scheduling.estimates import EventEstimator
from ray_xlong.scheduling.events import Event


def runs(*spans):
    """Events of runs ``(run, start, end or None)`` in time order (group = run // 2)."""
    out = []
    for run, start, end in spans:
        out.append(Event(start, "run_started", cell=0, run=run, group=run // 2, version=0))
        if end is not None:
            out.append(Event(end, "run_ended", cell=0, run=run, group=run // 2))
    return sorted(out, key=lambda e: e.time)


def test_live_runs_are_censored_not_dropped():
    # 2 runs ended at 1 h, 2 still live at 10 h: half the mass is beyond 10 h. Dropping the
    # live ones would say every run takes 1 h.
    est = EventEstimator(quantiles=4)
    est.observe(runs((0, 0.0, 1.0), (1, 0.0, 1.0), (2, 0.0, None), (3, 0.0, None)))
    q = est.duration_quantiles(now=10.0)
    assert q == (1.0, 1.0, 10.0, 10.0)
    assert est.horizon(10.0) == 10.0 and est.runs_ended == 2


def test_kaplan_meier_accounts_for_runs_censored_early():
    # ends at 1, 3; one censored at 2 (live, started at 8 -> age 2 at now=10)
    est = EventEstimator(quantiles=4)
    est.observe(runs((0, 0.0, 1.0), (1, 0.0, 3.0), (2, 8.0, None)))
    # KM: F(1) = 1/3; the run censored at 2 moves its mass past 2, so F(3) = 1 -> quantiles
    # at 1/8, 3/8, 5/8, 7/8 are 1, 3, 3, 3 (ignoring it would give 1, 1, 3, 3)
    assert est.duration_quantiles(now=10.0) == (1.0, 3.0, 3.0, 3.0)


def test_training_cell_time_per_group_counts_ready_unstarved_cells():
    est = EventEstimator(batch_groups=2, group_size=2)
    est.observe([
        Event(0.0, "step_started", cell=0, step=0),
        Event(1.0, "role", cell=1, role="training"),   # cell 1 switches (0.5 h), then joins
        Event(1.0, "step_joined", cell=1, step=0),
        Event(1.5, "ready", cell=1),
        Event(2.0, "step_starved", step=0),              # 2.0-3.0: waits for a group
        *runs((0, 0.5, 3.0), (1, 0.5, 3.0)),             # group 0 completes at 3.0
        Event(4.0, "step_ended", step=0, version=1),
    ])
    # cell 0: 0-2 and 3-4 (3 h); cell 1: 1.5-2 and 3-4 (1.5 h) -> 4.5 cell-h / 2 groups
    assert est.train_per_group() == pytest.approx(2.25)
    assert est.switch[-1] == pytest.approx(0.5)


def test_the_last_micro_batch_splits_training_from_the_step_finish():
    est = EventEstimator(batch_groups=1)
    est.observe([Event(0.0, "step_started", cell=0, step=0),
                 Event(2.0, "micro_batch", cell=0, step=0),
                 Event(2.5, "step_ended", step=0, version=1),
                 Event(2.5, "role", cell=0, role="syncing"), Event(2.7, "ready", cell=0)])
    got = est.estimates(3.0, min_runs=0)
    assert got is not None
    assert got.train_per_group == pytest.approx(2.0) and got.step_finish == pytest.approx(0.5)
    assert got.sync == pytest.approx(0.2)


def test_no_estimates_before_a_step_ended():
    est = EventEstimator(batch_groups=2)
    est.observe(runs((0, 0.0, 1.0)))
    assert est.estimates(1.0) is None and est.train_per_group() is None


def test_estimates_of_a_simulated_job_match_its_workload():
    from ray_xlong.scheduling.elastic import ElasticPolicy
    from ray_xlong.scheduling.state import SchedulingConfig
    from ray_xlong.sim.cluster import ClusterConfig, CostConfig
    from ray_xlong.sim.simulator import simulate
    from ray_xlong.sim.workload import WorkloadConfig, sample_workload

    job = SchedulingConfig(total_steps=12, batch_groups=8, runs_per_group=4, staleness_bound=2)
    w = sample_workload(WorkloadConfig(median_run_h=2.0, sigma=0.6, timeout_h=5.0,
                                       tokens_per_run_h=1000.0), runs=job.total_runs,
                        group_size=4, seed=3)
    costs = CostConfig(train_tokens_per_cell_h=4e4, step_fixed_h=0.05, to_train_h=0.1,
                       sync_h=0.2)
    result = simulate(ElasticPolicy(), workload=w, cluster=ClusterConfig(4, 1, 1, 16),
                      costs=costs, config=job)
    est = EventEstimator(batch_groups=8, group_size=4)
    est.observe(result.events)
    got = est.estimates(result.makespan_h)
    true_group = sum(w.tokens) / job.total_groups / costs.train_tokens_per_cell_h
    assert got.train_per_group == pytest.approx(true_group, rel=0.15)
    assert got.mean_duration == pytest.approx(sum(w.durations_h) / len(w.durations_h), rel=0.1)
    assert got.to_train == pytest.approx(0.1) and got.sync == pytest.approx(0.2)
    assert got.step_finish == pytest.approx(0.05)
