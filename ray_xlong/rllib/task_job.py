"""``TaskJob``: what the runs of an xlong training job do — a registered task on a real engine.

The cell actuator (``actuator.py``) asks its job's ``work`` object three things; this is the
learnable-task answer (the long-horizon oracle job is ``long_horizon_job.LongHorizonJob``)::

    spec(run, runs_per_group)   RunSpec(task, task seed of the run's group, "r{run}", "g{group}")
    tasks()                     {}  (the task is built in: ray_xlong.rollout.tasks.TASKS)
    engine_factory(model_dir)   None (each runner builds its ``RolloutConfig.backend`` engine)

Runs of one group share a task seed (GRPO groups); group ``g`` of a job that started at
``group_offset`` draws the seed of global group ``group_offset + g``, so a job restarted from a
checkpoint moves on to fresh task instances instead of replaying the first ones.

:func:`warm_started_model_dir` builds the tiny policy (model + tokenizer) and gives it the
lookup task's format by the supervised warm start of ``rollout.local_rl`` (the known-good
recipe); the directory is cached by seed, so several jobs of one seed share one warm start.
"""

from __future__ import annotations

import dataclasses
import pathlib

import numpy as np

from ray_xlong.rllib.env_runner import RunSpec

READY_MARKER = "xlong_warm_start.done"
"""File written into a model directory once its warm start finished."""


@dataclasses.dataclass(frozen=True, slots=True)
class TaskJob:
    """The task every run of a training job does."""

    task: str = "lookup"
    """Registered task name (``ray_xlong.rollout.tasks.TASKS``)."""
    seed: int = 0
    """Seed of the task instances."""
    group_offset: int = 0
    """Global index of this job's group 0 (a restored job continues after earlier groups)."""

    def __post_init__(self) -> None:
        from ray_xlong.rollout.tasks import TASKS

        if self.task not in TASKS:
            raise ValueError(f"TaskJob.task must be one of {sorted(TASKS)}, got {self.task!r}")
        if self.group_offset < 0:
            raise ValueError(f"TaskJob.group_offset must be >= 0, got {self.group_offset!r}")

    def task_seed(self, group: int) -> int:
        """Task seed of this job's group ``group`` (deterministic per seed and global group)."""
        rng = np.random.default_rng([self.seed, self.group_offset + group])
        return int(rng.integers(0, 2**31))

    def spec(self, run: int, *, runs_per_group: int) -> RunSpec:
        """What scheduler run id ``run`` starts."""
        group = run // runs_per_group
        return RunSpec(self.task, self.task_seed(group), f"r{run}", f"g{group}")

    def tasks(self) -> dict:
        """Nothing to register: the task is built in."""
        return {}

    def engine_factory(self, model_dir: str) -> None:
        """None: runners build their configured backend (hf | vllm)."""
        return None


def warm_started_model_dir(root: str | pathlib.Path, *, seed: int, warm=None) -> str:
    """A tiny policy directory warm-started on the lookup format (built once per ``root``).

    Args:
        root: where to build it (reused when it already holds a finished warm start).
        seed: model weights and warm-start seed.
        warm: ``rollout.local_rl.WarmStartConfig`` (default: the local RL recipe).

    Returns:
        The model directory (HF and vLLM load it; the tokenizer is saved with it).
    """
    from ray_xlong.models import build_tiny_model_dir
    from ray_xlong.rollout.chat import ChatFormat
    from ray_xlong.rollout.local_rl import WarmStartConfig, warm_start_policy

    path = pathlib.Path(root) / f"policy-seed{seed}"
    if (path / READY_MARKER).exists():
        return str(path)
    warm = warm or WarmStartConfig()

    def train(model, tokenizer):
        warm_start_policy(model, ChatFormat(tokenizer), warm, seed=seed)

    out = build_tiny_model_dir(path, seed=seed, train=train)
    (pathlib.Path(out) / READY_MARKER).write_text("ok\n")
    return str(out)
