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
