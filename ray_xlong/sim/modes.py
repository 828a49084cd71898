"""The modes the benchmark compares, built from a preset, and one call to simulate a preset.

Modes (policy objects from ``ray_xlong.scheduling``, unchanged):

* ``colocated`` / ``async`` / ``elastic`` — the paper's three systems;
* ``forecast`` — our own mode (:class:`~ray_xlong.scheduling.forecast.ForecastPolicy`): elastic
  cells sized by the work certain to arrive within the run timeout, drained ahead of need,
  newest-run-oldest first. Kept because it wins on every seed tried (paper-2.4t, seeds 0-4:
  68.9-69.5 h vs elastic's 79.8-83.1 h; ``benchmarks/scheduler_sim.py --compare-seeds``);
* ``forecast_online`` — forecast with its inputs learned from the job's own events
  (``scheduling/online.py``; elastic until a step ended);
* ``planned`` — simulates candidate plans over the remaining work and follows the best
  (``sim/planner.py``);
* ``async+streaming`` / ``colocated+streaming`` — the streaming-only ablation;
* ``best_static`` — async with the split (rollout / training cells) that the simulator finds
  best for the very workload it is then compared on: chosen with hindsight over every split
  (:func:`best_static_split`), so no fixed split does better on that workload.

An earlier own attempt (drain the cell holding the *oldest* run) won seed 0 and lost seed 1: a
drain ends with a cell's *newest* run, which the oldest run says nothing about.
"""

from __future__ import annotations

import dataclasses

from ray_xlong.scheduling.modes import ABLATION_MODES, PAPER_MODES, ModeInputs, make_policy
from ray_xlong.scheduling.policy import Policy
from ray_xlong.scheduling.estimates import JobEstimates
from ray_xlong.sim.planner import PlanCosts, planned_policy, prior_estimates
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
    """Every benchmarked mode for ``preset``, by name (``scheduling.modes``: the registry);
    ``forecast_online`` and ``planned`` learn from the simulated job's own events (new
    objects: simulate each once)."""
    inputs = dataclasses.replace(forecast_inputs(preset), planner=lambda: preset_planner(preset))
    return {mode: make_policy(mode, inputs) for mode in PAPER_MODES + ("forecast",)
            + ABLATION_MODES + ("forecast_online", "planned")}


def preset_planner(preset: Preset) -> Policy:
    """The planned policy for ``preset`` (``sim.planner``); what it cannot see in the events,
    the blocking step finish and the training parallelism, comes from the preset."""
    costs = PlanCosts(finish_blocks=preset.costs.finish_blocks,
                      parallel_training_cells=preset.costs.parallel_training_cells)
    return planned_policy(costs=costs, prior=preset_prior(preset))


def preset_prior(preset: Preset) -> JobEstimates:
    """What an operator knows before the job: the run-length distribution the job *starts*
    with (a drift or a shift to come is not known) and the cost model (as ``forecast`` is
    given: :func:`forecast_inputs`)."""
    w = dataclasses.replace(preset.workload, median_growth=1.0, token_rate_growth=1.0,
                            then=None)
    g = preset.job.runs_per_group
    sample = sample_workload(w, runs=512 * g, group_size=g, seed=987_654)  # 4,096 at G = 8
    per_group = g * w.tokens_per_run_h * w.mean_duration_h() * w.unique_token_frac \
        / preset.costs.train_tokens_per_cell_h
    c = preset.costs
    return prior_estimates(sample.durations_h, train_per_group=per_group,
                           to_train=c.to_train_h, sync=c.sync_h, step_finish=c.step_fixed_h)


def best_static_split(preset: Preset, *, workload: Workload,
                      coarse: bool = False) -> tuple[int, SimResult]:
    """The async split with the shortest makespan on ``workload`` (hindsight over 1..cells-1
    rollout cells; ties: fewer rollout cells). ``coarse`` (more than 9 cells): every 4th split,
    then every split within 3 of the best of those (the makespan falls, then rises, with the
    rollout pool: rollout-bound, then training-bound).

    Returns:
        ``(rollout_cells, its SimResult)`` (the result's mode is ``best_static``).
    """
    cells = preset.cluster.cells
    results: dict[int, SimResult] = {}

    def run(r: int) -> None:
        if 1 <= r < cells and r not in results:
            policy = make_policy("best_static", ModeInputs(best_static_rollout_cells=r))
            results[r] = simulate_preset(preset, policy, seed=0, workload=workload)

    stride = 1 if cells <= 9 or not coarse else 4
    for r in range(1, cells, stride):
        run(r)
    if stride > 1:  # refine around the best of the coarse grid
        top = min(results, key=lambda r: (results[r].makespan_h, r))
        for r in range(top - stride + 1, top + stride):
            run(r)
    r = min(results, key=lambda r: (results[r].makespan_h, r))
    return r, results[r]


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
