"""One training job end to end, shared by ``examples/train_elastic.py``, ``benchmarks/learning.py``
and ``ray-xlong train``::

    ensure a local Ray (embedded; RAY_TMPDIR under /tmp)
    model_dir = warm_started_model_dir(workdir, seed)        tiny LM + tokenizer, format warm start
    algo = XLongConfig()…xlong(mode, engine, task="lookup").build_algo()
    for step in 1..steps: algo.train()  → StepReport (progress bar + one table row per step)
    TrainRun(rewards, reports, events, seconds)               events → timeline PNG

The table's columns are the StepReport's: reward, tokens trained, unique / total tokens, token
staleness, cells by role (R rollout, D draining, T training, S syncing), busy share, seconds.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import tempfile
import time
from typing import Callable

from ray_xlong.cells.stepping import StepReport

HEADER = ("| step | reward | tokens | unique/total | stale | cells R/D/T/S | busy | step s |\n"
          "|---:|---:|---:|---:|---:|:---:|---:|---:|")
"""Markdown header of the per-step table."""


@dataclasses.dataclass(frozen=True, slots=True)
class TrainRun:
    """A finished training job."""

    mode: str
    """Scheduling mode."""
    seed: int
    """Seed (model, warm start, tasks, engines)."""
    engine: str
    """Inference backend."""
    rewards: tuple[float, ...]
    """Mean reward of each step's trained runs."""
    reports: tuple[StepReport, ...]
    """Per-step reports."""
    events: tuple
    """The cells' event log (simulator format)."""
    warm_start_s: float
    """Seconds to build (or reuse) the warm-started model."""
    startup_s: float
    """Seconds to build the algorithm (placement groups, actors, engines)."""
    train_s: float
    """Seconds of the training steps."""


def row(report: StepReport) -> str:
    """One markdown table row of ``report``."""
    c = report.cells_by_role
    cells = "/".join(str(c.get(r, 0)) for r in ("rollout", "draining", "training", "syncing"))
    return (f"| {report.version} | {report.reward_mean:.3f} | {report.tokens_trained} | "
            f"{report.unique_tokens}/{report.total_tokens} | {report.staleness_max} | {cells} | "
            f"{report.gpu_busy_frac:.2f} | {report.step_s:.1f} |")


def _harness(chat: str) -> dict:
    """The recipe's run budgets; a template's JSON tool call takes ~20 tokens, not ~5, and the
    template lists the tools in the prompt: no subagent tool (the warm start never saw one)."""
    from ray_xlong.rllib.algorithm_config import RECIPE_HARNESS

    if chat == "token":
        return {}
    return {"harness": dataclasses.replace(RECIPE_HARNESS, max_new_tokens=32,
                                           max_subagent_depth=0)}


def ensure_ray(cpus: int, gpus: int) -> None:
    """Start an embedded local Ray (temp dir under /tmp: Ray's socket paths are short; idle task
    workers kept: ``ray_edge.KEEP_TASK_WORKERS``)."""
    import ray

    if ray.is_initialized():
        return
    from ray_xlong.cells.ray_edge import KEEP_TASK_WORKERS

    os.environ.setdefault("RAY_TMPDIR", tempfile.mkdtemp(prefix="rx", dir="/tmp"))
    ray.init(num_cpus=cpus, num_gpus=gpus, include_dashboard=False, log_to_driver=False,
             _system_config=KEEP_TASK_WORKERS)


def run_training(*, mode: str, steps: int, seed: int, workdir: str | pathlib.Path,
                 engine: str = "hf", cells: int = 2, groups: int = 16, runs_per_group: int = 8,
                 staleness_bound: int = 1, warm=None, chat: str = "chatml_tiny",
                 on_step: Callable[[StepReport], None] | None = None, spec=None,
                 on_result: Callable[[dict], None] | None = None, loss=None) -> TrainRun:
    """Build (or reuse) the warm-started policy and run ``steps`` steps of ``mode``.

    Args:
        mode: scheduling mode (``colocated`` | ``async`` | ``elastic`` | …).
        steps: optimizer steps.
        seed: model, warm start, task and engine seed.
        workdir: where the policy directory is cached.
        engine: ``hf`` | ``vllm``.
        cells: cells (2 on this machine: one per CPU).
        groups: task instances per step.
        runs_per_group: runs per instance.
        staleness_bound: scheduler staleness bound.
        warm: ``rollout.lookup_recipe.WarmStartConfig`` (None: the recipe's).
        chat: the policy's chat style: ``chatml_tiny`` (a ChatML template, Hermes tool calls:
            the template path) | ``token`` (the demo model's own tokens) | ``chatml`` |
            ``llama3``.
        on_step: called with every step's report.
        spec: a ``train_config.TrainSpec``: the algorithm config comes from it (mode, engine,
            cells, groups and runs per group above are then ignored; its ``xlong.model_dir``,
            when set, replaces the warm-started policy).
        on_result: called with every ``algo.train()`` result (e.g. experiment trackers).
        loss: a ``trajectory.LossConfig`` (None: the default token PPO clip; ignored with
            ``spec``).

    Returns:
        :class:`TrainRun`.
    """
    from ray_xlong.rllib.algorithm_config import XLongConfig
    from ray_xlong.cells.task_job import warm_started_model_dir

    t0 = time.perf_counter()
    model_dir = (spec.xlong.model_dir if spec is not None and spec.xlong.model_dir
                 else warm_started_model_dir(workdir, seed=seed, warm=warm, style=chat))
    t1 = time.perf_counter()
    if spec is not None:
        cells = spec.algorithm_config(model_dir=model_dir).num_cells
    ensure_ray(cpus=max(os.cpu_count() or 1, cells), gpus=cells)
    config = spec.algorithm_config(model_dir=model_dir) if spec is not None else (
        XLongConfig().debugging(seed=seed).lookup_recipe()
        .training(train_batch_size_per_learner=groups * runs_per_group)
        .xlong(mode=mode, cells=cells, runs_per_group=runs_per_group, engine=engine,
               model_dir=model_dir, staleness_bound=staleness_bound,
               placement_strategy="PACK", **_harness(chat),
               **({"loss": loss} if loss is not None else {})))
    algo = config.build_algo()
    t2 = time.perf_counter()
    try:
        for _ in range(steps):
            result = algo.train()
            if on_result is not None:
                on_result(result)
            if on_step is not None:
                on_step(algo.reports[-1])
        events = tuple(algo.events())
    finally:
        algo.stop()
    reports = tuple(algo.reports)
    return TrainRun(mode, seed, engine, tuple(r.reward_mean for r in reports), reports, events,
                    t1 - t0, t2 - t1, time.perf_counter() - t2)
