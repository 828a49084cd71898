"""The modes the benchmark compares, built from a preset, and one call to simulate a preset.

Modes (policy objects from ``ray_xlong.scheduling``, unchanged):

* ``colocated`` / ``async`` / ``elastic`` — the paper's three systems;
* ``async+streaming`` / ``colocated+streaming`` — the streaming-only ablation;

Our own attempt to beat elastic (drain the cell holding the oldest runs) won on seed 0 (82.16 h
vs 83.07 h) and lost on seed 1 (81.35 h vs 79.77 h), so it was not kept (issue 4: keep only if
it wins).
"""

from __future__ import annotations

import dataclasses

from ray_xlong.scheduling.asynchronous import AsyncPolicy
from ray_xlong.scheduling.colocated import ColocatedPolicy
from ray_xlong.scheduling.elastic import ElasticPolicy
from ray_xlong.scheduling.policy import Policy
from ray_xlong.sim.presets import Preset
from ray_xlong.sim.simulator import SimResult, simulate
from ray_xlong.sim.workload import Workload, sample_workload

PAPER_MODES = ("colocated", "async", "elastic")
ABLATION_MODES = ("async+streaming", "colocated+streaming")


def make_policies(preset: Preset) -> dict[str, Policy]:
    """Every benchmarked mode for ``preset``, by name."""
    r = preset.async_rollout_cells
    return {
        "colocated": ColocatedPolicy(),
        "async": AsyncPolicy(rollout_cells=r),
        "elastic": ElasticPolicy(),
        "async+streaming": AsyncPolicy(rollout_cells=r, streaming=True, name="async+streaming"),
        "colocated+streaming": ColocatedPolicy(streaming=True, name="colocated+streaming"),
    }


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
