"""mode_bench's paper8 size without Ray: the paper-2.4t run-length shape compressed to seconds,
and best_static = the split the simulator finds best on the calibrated workload."""

from __future__ import annotations

import numpy as np
import pytest

from ray_xlong.cells.long_horizon_job import predicted_durations
from ray_xlong.jobs.mode_bench import (
    PAPER8_MODES, SIZES, best_static_rollout_cells, build_config, mode_policy, sim_inputs,
)

CAL = {"call_s": 0.01, "train_tokens_per_s": 2000.0, "tokens_per_run": 300.0,
       "switch_s": 0.1, "sync_s": 0.2, "step_finish_s": 0.2}
"""A made-up calibration (the real one is measured on Ray in the same run)."""


def test_paper8_is_the_paper_shape_compressed_to_seconds():
    config = build_config(SIZES["paper8"], model_dir="/unused", seed=0)
    assert config.layout.cells == 8 and config.job.total_steps >= 6
    assert config.job.staleness_bound == 7 and config.harness.wall_clock_s == pytest.approx(6.0)
    assert not config.work.model_logprobs                         # light runners
    tool = np.array(predicted_durations(config.work, runs=400, call_s=0.0, timeout_s=1e9))
    # median 5 s (paper: 5 h), log-std 0.8 -> 61% of runs >= 4 s before the 6 s cut
    assert np.median(tool) == pytest.approx(5.0, rel=0.15)
    assert np.std(np.log(tool)) == pytest.approx(0.8, abs=0.1)
    assert np.mean(tool >= 4.0) == pytest.approx(0.61, abs=0.07)
    assert set(PAPER8_MODES) == {"colocated", "async", "elastic", "forecast", "forecast_online",
                                 "best_static", "planned"}


def test_best_static_is_the_best_async_split_in_the_simulator():
    from ray_xlong.scheduling.asynchronous import AsyncPolicy
    from ray_xlong.sim.simulator import simulate

    size = dict(SIZES["paper8"], steps=3)
    config = build_config(size, model_dir="/unused", seed=0)
    workload, cluster, costs = sim_inputs(config, CAL)
    best = best_static_rollout_cells(config, CAL)
    hours = [simulate(AsyncPolicy(rollout_cells=r), workload=workload, cluster=cluster,
                      costs=costs, config=config.job).makespan_h for r in range(1, 8)]
    assert hours[best - 1] == min(hours)
    cfg, policy = mode_policy("best_static", config, CAL)
    assert cfg.mode == "async" and cfg.async_rollout_cells == best == policy.rollout_cells
    assert policy.name == "best_static"


def test_the_simulator_of_a_ray_job_blocks_on_the_step_finish_as_the_driver_does():
    # RayActuator._finish_step waits for the reduce, the optimizer step and the weight push;
    # the simulator of the same job must hold what happens meanwhile, not let rollout go on
    config = build_config(SIZES["paper8"], model_dir="/unused", seed=0)
    _, _, costs = sim_inputs(config, CAL)
    assert costs.finish_blocks and costs.step_fixed_h == CAL["step_finish_s"]


def test_the_embedded_ray_keeps_idle_task_workers():
    # 16 actors on 8 logical CPUs: above Ray's default soft limit every idle task worker is
    # killed, and each step's gradient sum paid a fresh Python worker (4-5 s measured)
    from ray_xlong.cells.ray_edge import KEEP_TASK_WORKERS

    assert KEEP_TASK_WORKERS["num_workers_soft_limit"] > 2 * SIZES["paper8"]["cells"]


def test_the_learning_modes_get_a_fresh_policy_each_and_a_job_mode_that_names_them():
    from ray_xlong.scheduling.online import OnlineForecastPolicy
    from ray_xlong.sim.planner import PlannedPolicy

    config = build_config(SIZES["paper8"], model_dir="/unused", seed=0)
    cal = dict(CAL, parallel_training_cells=2.5)
    cfg, online = mode_policy("forecast_online", config, cal)
    assert cfg.mode == "forecast" and isinstance(online, OnlineForecastPolicy)
    cfg, planned = mode_policy("planned", config, cal)
    assert cfg.mode == "planned" and isinstance(planned, PlannedPolicy)
    assert planned.costs.finish_blocks and planned.costs.parallel_training_cells == 2.5
    assert mode_policy("planned", config, cal)[1] is not planned   # Ray and sim: one each
    # it plans at job start from the calibration: its costs, the calibration seed's runs
    prior = planned.prior
    assert prior.train_per_group == pytest.approx(2 * 300.0 / 2000.0)
    assert prior.step_finish == 0.2 and prior.sync == 0.2 and prior.to_train == 0.1
    from ray_xlong.jobs.mode_bench import PLAN_WALL_BUDGET
    assert planned.costs.wall_budget == PLAN_WALL_BUDGET
    assert 0 < min(prior.duration_quantiles) <= max(prior.duration_quantiles) <= 6.0 + 1e-9
