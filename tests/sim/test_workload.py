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
