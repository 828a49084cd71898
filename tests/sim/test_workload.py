"""Workload sampling: deterministic, capped at the timeout, validated configs."""

from __future__ import annotations

import pytest

from ray_xlong.sim.workload import WorkloadConfig, sample_workload

CFG = WorkloadConfig(median_run_h=5.0, sigma=0.8, timeout_h=6.0, tokens_per_run_h=1000.0)


def test_same_seed_same_workload_and_durations_capped():
    a = sample_workload(CFG, runs=64, group_size=8, seed=3)
    assert a == sample_workload(CFG, runs=64, group_size=8, seed=3)
    assert a != sample_workload(CFG, runs=64, group_size=8, seed=4)
    assert all(0 < d <= 6.0 for d in a.durations_h)
    assert a.tokens[0] == pytest.approx(1000.0 * a.durations_h[0])


def test_frac_at_least_matches_the_paper_figure_for_the_preset_shape():
    # median 5.0 = 4·exp(0.2793·0.8) -> 61% of runs >= 4 h
    assert CFG.frac_at_least(4.0) == pytest.approx(0.61, abs=0.002)


@pytest.mark.parametrize(
    "field, value",
    [("median_run_h", 0.0), ("sigma", -1.0), ("timeout_h", 0.0), ("task_corr", 1.5),
     ("unique_token_frac", 0.0)],
)
def test_bad_config_names_the_field(field, value):
    kwargs = dict(median_run_h=1.0, sigma=0.5, timeout_h=2.0, tokens_per_run_h=1.0)
    kwargs[field] = value
    with pytest.raises(ValueError, match=f"WorkloadConfig.{field}"):
        WorkloadConfig(**kwargs)


def _group_medians(w, groups: int) -> list[float]:
    import statistics

    g = w.group_size
    return [statistics.median(w.durations_h[k * g:(k + 1) * g]) for k in range(groups)]


def test_drift_doubles_the_median_and_timeout_across_the_job():
    # median_growth 2: group k has median 5 · 2^(k / 99) and timeout 6 · 2^(k / 99)
    import statistics

    drift = WorkloadConfig(median_run_h=5.0, sigma=0.3, timeout_h=6.0, tokens_per_run_h=1000.0,
                           median_growth=2.0, token_rate_growth=0.5)
    w = sample_workload(drift, runs=100 * 64, group_size=64, seed=0)
    med = _group_medians(w, 100)
    first, last = statistics.fmean(med[:10]), statistics.fmean(med[-10:])
    assert 1.6 < last / first < 2.2  # (capped at the timeout; geometric over the 10-group windows)
    assert max(w.durations_h[-64:]) <= 12.0 + 1e-9 and max(w.durations_h[-64:]) > 6.0
    # token rate halves: the last group's tokens per hour are 500
    assert w.tokens[-1] == pytest.approx(500.0 * w.durations_h[-1])
    assert not drift.stationary and drift.max_timeout_h == pytest.approx(12.0)


def test_shift_switches_the_distribution_at_then_from():
    later = WorkloadConfig(median_run_h=20.0, sigma=0.0, timeout_h=30.0, tokens_per_run_h=1.0)
    shift = WorkloadConfig(median_run_h=1.0, sigma=0.0, timeout_h=2.0, tokens_per_run_h=1.0,
                           then=later, then_from=0.25)
    w = sample_workload(shift, runs=8 * 2, group_size=2, seed=0)
    # 8 groups, then_from 0.25 -> groups 0-1 at 1 h, groups 2-7 at 20 h
    assert w.durations_h == (1.0,) * 4 + (20.0,) * 12
    assert shift.max_timeout_h == 30.0
    with pytest.raises(ValueError, match="WorkloadConfig.then_from"):
        WorkloadConfig(median_run_h=1, sigma=0, timeout_h=2, tokens_per_run_h=1, then_from=1.0)


def test_stationary_config_samples_as_before_drift_existed():
    # the drift fields at their defaults must not change a stationary workload
    w = sample_workload(CFG, runs=16, group_size=8, seed=3)
    assert CFG.stationary
    # values printed by the sampler before the drift fields were added (same seed)
    assert w.durations_h[:4] == (6.0, 3.1747288512979144, 3.4809960661813566, 4.207885150632433)
    assert w.tokens[1] == 3174.7288512979144
