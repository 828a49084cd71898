"""Impossible job configs (issue 7, item 5): a ValueError naming the field, at construction or
at ``XLongConfig.validate`` — never a job that starts and then hangs or trains wrongly.

Complements ``test_enable.py`` (mode, engine, staleness, K, task) and ``test_cells.py`` (layouts
that do not fit the cluster: more cells than nodes).
"""

from __future__ import annotations

import pytest

from ray_xlong.rllib.algorithm_config import XLongConfig, XLongOptions
from ray_xlong.cells.layout import CellLayout
from ray_xlong.cells.config import CellJobConfig
from ray_xlong.cells.config import LearnerSettings
from ray_xlong.scheduling import SchedulingConfig

pytestmark = [pytest.mark.rllib, pytest.mark.timeout(120)]


@pytest.mark.parametrize("kwargs,field", [
    pytest.param(dict(micro_batch_tokens=0), "micro_batch_tokens", id="micro-batch-0"),
    pytest.param(dict(micro_batch_tokens=0.5), "micro_batch_tokens", id="micro-batch-half"),
    pytest.param(dict(staleness_bound=-1), "staleness_bound", id="negative-staleness"),
    pytest.param(dict(staleness_bound=0.5), "staleness_bound", id="fractional-staleness"),
    pytest.param(dict(max_trajectories_per_run=0), "max_trajectories_per_run", id="k-0"),
    pytest.param(dict(runs_per_group=0), "runs_per_group", id="empty-groups"),
    pytest.param(dict(cells=0), "cells", id="no-cells"),
    pytest.param(dict(slots_per_cell=True), "slots_per_cell", id="bool-slots"),
    pytest.param(dict(poll_s=0.0), "poll_s", id="poll-0"),
])
def test_xlong_options_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"XLongOptions.{field}"):
        XLongOptions(**kwargs)


def test_runs_per_step_must_be_whole_groups():
    config = XLongConfig().training(train_batch_size_per_learner=12).xlong(runs_per_group=8)
    with pytest.raises(ValueError, match="runs_per_group=8"):
        config.groups_per_step


def test_cells_and_env_runners_must_agree():
    config = XLongConfig().env_runners(num_env_runners=3).xlong(cells=2)
    with pytest.raises(ValueError, match="cells=2.*num_env_runners=3"):
        config.num_cells


def job(**kw):
    base = dict(mode="async", job=SchedulingConfig(2, 2, 2, 1), layout=CellLayout(cells=3),
                learner=LearnerSettings(model_dir="/nonexistent"))
    return CellJobConfig(**{**base, **kw})


@pytest.mark.parametrize("kwargs,field", [
    pytest.param(dict(async_rollout_cells=3), "async_rollout_cells", id="pool-takes-every-cell"),
    pytest.param(dict(async_rollout_cells=0), "async_rollout_cells", id="empty-pool"),
    pytest.param(dict(async_rollout_cells=1.5), "async_rollout_cells", id="fractional-pool"),
    pytest.param(dict(slots_per_cell=True), "slots_per_cell", id="bool-slots"),
    pytest.param(dict(slots_per_cell=2.5), "slots_per_cell", id="fractional-slots"),
])
def test_cell_job_config_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"CellJobConfig.{field}"):
        job(**kwargs)


@pytest.mark.parametrize("kwargs,field", [
    pytest.param(dict(micro_batch_tokens=0), "micro_batch_tokens", id="micro-batch-0"),
    pytest.param(dict(lr=0.0), "lr", id="lr-0"),
    pytest.param(dict(grad_clip=-1.0), "grad_clip", id="negative-clip"),
])
def test_learner_settings_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"LearnerSettings.{field}"):
        LearnerSettings(model_dir="/m", **kwargs)
