"""Cell layouts (pure: no Ray) and the job config: impossible layouts and bad fields raise
errors that name the numbers / the field."""

from __future__ import annotations

import pytest

from ray_xlong.cells.layout import CellLayout, LayoutError, check_layout
from ray_xlong.cells.config import MODES, CellJobConfig, make_policy
from ray_xlong.cells.config import LearnerSettings
from ray_xlong.scheduling import SchedulingConfig

NODE = {"CPU": 2.0, "GPU": 2.0}          # holds 2 bundles of {CPU: 1, GPU: 1}


def nodes(n, **res):
    return [dict(NODE, **res) for _ in range(n)]


@pytest.mark.parametrize("layout,cluster", [
    pytest.param(CellLayout(cells=4, nodes_per_cell=2), nodes(4), id="4x2-on-4-nodes"),
    pytest.param(CellLayout(cells=2, nodes_per_cell=4), nodes(4), id="2x4-spread"),
    pytest.param(CellLayout(cells=4, strategy="PACK"), nodes(2), id="pack"),
    pytest.param(CellLayout(cells=1, nodes_per_cell=2, strategy="STRICT_PACK"), nodes(1),
                 id="strict-pack"),
])
def test_layouts_that_fit(layout, cluster):
    check_layout(layout, cluster)


@pytest.mark.parametrize("layout,cluster,match", [
    pytest.param(CellLayout(cells=5, nodes_per_cell=2), nodes(4),
                 r"5 cells × nodes_per_cell=2 = 10 bundles .* 4 nodes hold 8", id="too-many"),
    pytest.param(CellLayout(cells=1, nodes_per_cell=3), nodes(2),
                 r"nodes_per_cell=3 need .* has 2 of 2", id="spread-needs-nodes"),
    pytest.param(CellLayout(cells=2, gpus_per_node=4), nodes(4),
                 r"gpus_per_node=4", id="gpus-per-node"),
    pytest.param(CellLayout(cells=2, learner_resource="learner_slot"), nodes(4),
                 r"learner_slot", id="missing-custom-resource"),
])
def test_impossible_layouts_name_the_numbers(layout, cluster, match):
    with pytest.raises(LayoutError, match=match):
        check_layout(layout, cluster)


@pytest.mark.parametrize("kwargs,match", [
    pytest.param(dict(cells=0), "CellLayout.cells", id="cells"),
    pytest.param(dict(cells=1, strategy="RING"), "CellLayout.strategy", id="strategy"),
    pytest.param(dict(cells=1, learner_resource="GPU"), "learner_resource", id="gpu-learner"),
])
def test_bad_layout_fields(kwargs, match):
    with pytest.raises(ValueError, match=match):
        CellLayout(**kwargs)


def config(**kw):
    base = dict(mode="elastic", job=SchedulingConfig(2, 2, 2, 1), layout=CellLayout(cells=3),
                learner=LearnerSettings(model_dir="/nonexistent"))
    return CellJobConfig(**{**base, **kw})


@pytest.mark.parametrize("kwargs,match", [
    pytest.param(dict(mode="fast"), "CellJobConfig.mode", id="mode"),
    pytest.param(dict(mode="async", async_rollout_cells=3), "async_rollout_cells", id="pools"),
    pytest.param(dict(slots_per_cell=0), "slots_per_cell", id="slots"),
])
def test_bad_config_fields(kwargs, match):
    with pytest.raises(ValueError, match=match):
        config(**kwargs)
    with pytest.raises(ValueError, match="LearnerSettings.dtype"):
        LearnerSettings(model_dir="/m", dtype="fp8")


def test_one_field_picks_the_mode():
    names = {m: make_policy(config(mode=m, async_rollout_cells=2)).name for m in MODES}
    assert names == {m: m for m in MODES}
