"""paper-2.4t: provenance-carrying parameters; colocated and async reproduce the paper (slow)."""

from __future__ import annotations

import pytest

from ray_xlong.sim.modes import make_policies, preset_workload, simulate_preset
from ray_xlong.sim.presets import PAPER_2_4T, PAPER_HOURS, get_preset


def test_preset_lookup_and_paper_figures():
    assert get_preset("paper-2.4t") is PAPER_2_4T
    with pytest.raises(ValueError, match="paper-2.4t"):
        get_preset("nope")
    assert PAPER_2_4T.job.total_steps == 48 and PAPER_2_4T.cluster.cells == 8
    assert PAPER_2_4T.workload.frac_at_least(4.0) == pytest.approx(0.61, abs=0.005)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["colocated", "async"])
def test_calibrated_modes_within_3_percent(mode):
    w = preset_workload(PAPER_2_4T, seed=0)
    result = simulate_preset(PAPER_2_4T, make_policies(PAPER_2_4T)[mode], seed=0, workload=w)
    assert result.makespan_h == pytest.approx(PAPER_HOURS[mode], rel=0.03)


def test_drift_and_shift_presets_move_the_rollout_share():
    # same cluster / costs / job as paper-2.4t; the rollout ÷ training work of a step grows
    import numpy as np

    from ray_xlong.sim.presets import PAPER_2_4T_DRIFT, PAPER_2_4T_SHIFT

    for preset in (PAPER_2_4T_DRIFT, PAPER_2_4T_SHIFT):
        assert (preset.cluster, preset.costs, preset.job) == \
            (PAPER_2_4T.cluster, PAPER_2_4T.costs, PAPER_2_4T.job)
        w = preset_workload(preset, seed=0)
        d = np.asarray(w.durations_h).reshape(48, -1).sum(1)
        t = np.asarray(w.tokens).reshape(48, -1).sum(1)
        ratio = d / t
        assert ratio[-1] / ratio[0] > 1.8  # tokens a run stay ~700k while run time doubles+
    drift = preset_workload(PAPER_2_4T_DRIFT, seed=0)
    assert max(drift.durations_h) > 6.0 and get_preset("paper-2.4t-shift") is PAPER_2_4T_SHIFT


def test_best_static_is_no_worse_than_any_split():
    from ray_xlong.scheduling.asynchronous import AsyncPolicy
    from ray_xlong.sim.modes import best_static_split, with_steps

    preset = with_steps(PAPER_2_4T, 2)
    w = preset_workload(preset, seed=0)
    split, best = best_static_split(preset, workload=w)
    assert best.mode == "best_static" and 1 <= split < preset.cluster.cells
    for r in range(1, preset.cluster.cells):
        other = simulate_preset(preset, AsyncPolicy(rollout_cells=r), seed=0, workload=w)
        assert best.makespan_h <= other.makespan_h
    assert simulate_preset(preset, AsyncPolicy(rollout_cells=split), seed=0,
                           workload=w).makespan_h == best.makespan_h
