"""The processor end to end: stats, timeouts, failures, advantages, config validation."""

from __future__ import annotations

import pytest

from ray_xlong.trajectory import (ProcessorConfig, TrajectoryProcessor, group_advantages)
from ray_xlong.trajectory.synthetic import SyntheticConfig, synthetic_runs
from tests.trajectory.words import DONE, EDIT, PLAN, SYS, TASK, TOOL, mk, mkrun


def two_step_run(run_id, reward, status="finished", group="g"):
    return mkrun([mk("main", "main", [SYS, TASK], [PLAN]),
                  mk("main", "main", [SYS, TASK, PLAN, TOOL], [EDIT, DONE])],
                 run_id=run_id, group_id=group, reward=reward, status=status)


def test_timeout_runs_are_trained_with_their_partial_reward():
    runs = [two_step_run("a", 1.0), two_step_run("b", 0.25, "timeout")]
    batch = TrajectoryProcessor(ProcessorConfig(pack="tree")).process(runs)
    assert batch.stats.runs == 2 and batch.stats.runs_timeout == 1
    # mean = 0.625 → advantages +0.375 / −0.375
    assert batch.advantages == {"a": 0.375, "b": -0.375}
    assert set(batch.packed.advantages.tolist()) == {0.375, -0.375}


def test_failed_runs_are_reported_and_left_out_of_training_and_baseline():
    runs = [two_step_run("a", 1.0), two_step_run("b", 0.0), two_step_run("c", 0.0, "failed")]
    batch = TrajectoryProcessor(ProcessorConfig(pack="tree")).process(runs)
    assert batch.failed_run_ids == ("c",) and batch.stats.runs_failed == 1
    assert set(batch.trees) == {"a", "b"}
    assert batch.advantages == {"a": 0.5, "b": -0.5}           # mean over a, b only
    assert batch.packed.run_ids == ("a", "b")


@pytest.mark.parametrize("rewards, normalize, expected", [
    pytest.param([1.0, 0.0], False, [0.5, -0.5], id="mean-baseline"),
    # std of {1, 0} is 0.5 → ±0.5 / 0.5 = ±1
    pytest.param([1.0, 0.0], True, [1.0, -1.0], id="std-normalized"),
    pytest.param([0.7], False, [0.0], id="single-run-group"),
    pytest.param([0.3, 0.3], True, [0.0, 0.0], id="equal-rewards"),
])
def test_group_advantages(rewards, normalize, expected):
    runs = [two_step_run(f"r{i}", r) for i, r in enumerate(rewards)]
    adv = group_advantages(runs, normalize_std=normalize)
    assert [adv[r.run_id] for r in runs] == pytest.approx(expected, abs=1e-5)


def test_advantages_are_per_group():
    runs = [two_step_run("a", 1.0, group="x"), two_step_run("b", 0.0, group="x"),
            two_step_run("c", 5.0, group="y")]
    assert group_advantages(runs) == {"a": 0.5, "b": -0.5, "c": 0.0}


def test_stats_on_synthetic_runs_are_consistent():
    runs = synthetic_runs(0, groups=2, runs_per_group=3, config=SyntheticConfig.small())
    batch = TrajectoryProcessor(ProcessorConfig(max_trajectories_per_run=2)).process(runs)
    s = batch.stats
    assert s.runs + s.runs_failed == 6
    assert s.trajectories_kept == len(batch.trajectories) <= 2 * s.runs
    assert s.unique_tokens <= s.total_tokens
    assert s.trainable_tokens == s.weighted_trainable_tokens == batch.packed.num_targets
    assert s.trainable_tokens <= s.trajectory_trainable_tokens
    assert s.dedup_ratio >= 1.0
    assert "TrajectoryBatch(runs=" in repr(batch)


@pytest.mark.parametrize("field, value", [
    pytest.param("pack", "ragged", id="pack"),
    pytest.param("loss_norm", "seq", id="loss_norm"),
    pytest.param("row_tokens", 0, id="row_tokens"),
    pytest.param("pad_token_id", -1, id="pad_token_id"),
    pytest.param("max_trajectories_per_run", 2.5, id="max_trajectories_per_run"),
])
def test_impossible_config_names_the_field(field, value):
    with pytest.raises(ValueError, match=f"ProcessorConfig.{field}"):
        ProcessorConfig(**{field: value})


def test_processor_rejects_a_non_config():
    with pytest.raises(TypeError, match="ProcessorConfig"):
        TrajectoryProcessor({"pack": "tree"})
