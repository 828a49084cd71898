"""The modes the benchmark compares, built from a preset, and one call to simulate a preset.

Modes (policy objects from ``ray_xlong.scheduling``, unchanged):

* ``colocated`` / ``async`` / ``elastic`` — the paper's three systems;
* ``forecast`` — our own mode (:class:`~ray_xlong.scheduling.forecast.ForecastPolicy`): elastic
  cells sized by the work certain to arrive within the run timeout, drained ahead of need,
  newest-run-oldest first. Kept because it wins on every seed tried (paper-2.4t, seeds 0-4:
  68.9-69.5 h vs elastic's 79.8-83.1 h; ``benchmarks/scheduler_sim.py --compare-seeds``);
* ``async+streaming`` / ``colocated+streaming`` — the streaming-only ablation.

An earlier own attempt (drain the cell holding the *oldest* run) won seed 0 and lost seed 1: a
drain ends with a cell's *newest* run, which the oldest run says nothing about.
"""

from __future__ import annotations

import dataclasses

from ray_xlong.scheduling.modes import ABLATION_MODES, PAPER_MODES, ModeInputs, make_policy
from ray_xlong.scheduling.policy import Policy
from ray_xlong.sim.presets import Preset
from ray_xlong.sim.simulator import SimResult, simulate
from ray_xlong.sim.workload import Workload, sample_workload

def forecast_inputs(preset: Preset) -> ModeInputs:
    """What our own mode is given: only what an operator knows, the run timeout and the
    expected training throughput (cost model ÷ expected trained tokens of a group). Nothing
    is fitted."""
    w, g = preset.workload, preset.job.runs_per_group
    group_tokens = g * w.tokens_per_run_h * w.mean_duration_h() * w.unique_token_frac
    per_h = preset.costs.train_tokens_per_cell_h / group_tokens
    return ModeInputs(async_rollout_cells=preset.async_rollout_cells,
                      train_groups_per_cell_h=per_h, horizon_h=w.timeout_h)


def forecast_policy(preset: Preset) -> Policy:
    """Our own mode for ``preset`` (the registry's ``forecast``)."""
    return make_policy("forecast", forecast_inputs(preset))


def make_policies(preset: Preset) -> dict[str, Policy]:
    """Every benchmarked mode for ``preset``, by name (``scheduling.modes``: the registry)."""
    inputs = forecast_inputs(preset)
    return {mode: make_policy(mode, inputs) for mode in PAPER_MODES + ("forecast",)
            + ABLATION_MODES}


def with_steps(preset: Preset, steps: int) -> Preset:
    """The same preset with a different number of steps (tiny-budget runs)."""
    return dataclasses.replace(preset, job=dataclasses.replace(preset.job, total_steps=steps))


def preset_workload(preset: Preset, *, seed: int) -> Workload:
    """The preset's workload, sampled for every run of the job."""
    return sample_workload(
        preset.workload, runs=preset.job.total_runs, group_size=preset.job.runs_per_group, seed=seed
    )


def simulate_preset(preset: Preset, policy: Policy, *, seed: int,
                    workload: Workload | None = None) -> SimResult:
    """Simulate ``policy`` on ``preset`` (workload sampled from ``seed`` unless given)."""
    w = workload if workload is not None else preset_workload(preset, seed=seed)
    return simulate(policy, workload=w, cluster=preset.cluster, costs=preset.costs, config=preset.job)
