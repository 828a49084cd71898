"""``TaskJob``: what the runs of an xlong training job do — a registered task on a real engine.

The cell actuator (``actuator.py``) asks its job's ``work`` object three things; this is the
learnable-task answer (the long-horizon oracle job is ``long_horizon_job.LongHorizonJob``)::

    spec(run, runs_per_group)   RunSpec(task, task seed of the run's group, "r{run}", "g{group}")
    tasks()                     {task: factory} for a task that is not built in, else {}
    agent_tasks()               {task: agent} when the task is an external agent, else {}
    engine_factory(model_dir)   None (each runner builds its ``RolloutConfig.backend`` engine)

With ``agent`` (``make(seed) -> serving.agents.AgentTask``) the task is an external agent
registered under ``task`` in every runner: a run started on a cell is opened on that cell's
endpoint and the agent gets that endpoint's base URL (``rllib/env_runner.py``); its recording
ends on the cell and is processed there like a harness run.

Runs of one group share a task seed (GRPO groups); group ``g`` of a job that started at
``group_offset`` draws the seed of global group ``group_offset + g``, so a job restarted from a
checkpoint moves on to fresh task instances instead of replaying the first ones.

:func:`warm_started_model_dir` builds the tiny policy (model + tokenizer) and gives it the
lookup task's format by the supervised warm start of ``rollout/lookup_recipe.py`` (the known-good
recipe, checked: ``rollout/lookup_recipe.py``); the directory is cached by seed and warm-start
config, so several jobs of one seed share one warm start.
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import pathlib

from typing import Any, Callable

import numpy as np

from ray_xlong.cells.runs import RunSpec, group_key, run_key

READY_MARKER = "xlong_warm_start.done"
"""File written into a model directory once its warm start finished (and passed its check)."""
REPORT = "xlong_warm_start.json"
"""The warm start's ``WarmStartReport`` (scores, steps, losses) as JSON, in the directory."""
WARM_START_VERSION = 2
"""Part of the cache key: bumped when the warm-start code changes what a config produces
(2: checked warm start, one optimizer across phases)."""


@dataclasses.dataclass(frozen=True, slots=True)
class TaskJob:
    """The task every run of a training job does."""

    task: str = "lookup"
    """Registered task name (``ray_xlong.rollout.tasks.TASKS``)."""
    seed: int = 0
    """Seed of the task instances."""
    group_offset: int = 0
    """Global index of this job's group 0 (a restored job continues after earlier groups)."""
    agent: Callable[[int], Any] | None = None
    """An external agent as the task: ``make(seed) -> serving.agents.AgentTask`` (picklable),
    registered under ``task`` in every runner; None: ``task`` is a built-in task."""
    factory: Callable[[int], Any] | None = None
    """The task's factory ``make(seed) -> TaskEnv`` when it is not built in (picklable),
    registered under ``task`` in every runner. A factory with ``indexed_instances = True``
    (a dataset) is called with the global group index instead of a hashed seed."""

    def __post_init__(self) -> None:
        from ray_xlong.rollout.tasks import TASKS

        if self.agent is not None:
            if not callable(self.agent) or not isinstance(self.task, str) or not self.task \
                    or self.task in TASKS:
                raise ValueError(f"TaskJob: with agent= the task is a new name for the external "
                                 f"agent (not a built-in task {sorted(TASKS)}) and agent is "
                                 f"make(seed) -> AgentTask; got task={self.task!r}, "
                                 f"agent={self.agent!r}")
        elif self.factory is not None:
            if not callable(self.factory) or not isinstance(self.task, str) or not self.task:
                raise ValueError(f"TaskJob: with factory= the task is its name and factory is "
                                 f"make(seed) -> TaskEnv; got task={self.task!r}, "
                                 f"factory={self.factory!r}")
        elif self.task not in TASKS:
            raise ValueError(f"TaskJob.task must be one of {sorted(TASKS)}, got {self.task!r}")
        if self.group_offset < 0:
            raise ValueError(f"TaskJob.group_offset must be >= 0, got {self.group_offset!r}")

    def task_seed(self, group: int) -> int:
        """Task seed of this job's group ``group`` (deterministic per seed and global group;
        an indexed factory gets the global group index itself)."""
        if getattr(self.factory, "indexed_instances", False):
            return self.group_offset + group
        rng = np.random.default_rng([self.seed, self.group_offset + group])
        return int(rng.integers(0, 2**31))

    def spec(self, run: int, *, runs_per_group: int) -> RunSpec:
        """What scheduler run id ``run`` starts."""
        group = run // runs_per_group
        return RunSpec(self.task, self.task_seed(group), run_key(run), group_key(group))

    def tasks(self) -> dict:
        """``{task: factory}`` to register in every runner (``{}`` for a built-in task)."""
        return {self.task: self.factory} if self.factory is not None else {}

    def agent_tasks(self) -> dict:
        """``{task: agent}`` to register in every runner (``{}`` for a built-in task)."""
        return {self.task: self.agent} if self.agent is not None else {}

    def engine_factory(self, model_dir: str) -> None:
        """None: runners build their configured backend (hf | vllm)."""
        return None


def warm_started_model_dir(root: str | pathlib.Path, *, seed: int, warm=None,
                           style: str = "token") -> str:
    """A tiny policy directory warm-started on the lookup format (built once per ``root``).

    Args:
        root: where to build it (reused when it already holds a finished warm start of the
            same seed and warm-start config).
        seed: model weights and warm-start seed.
        warm: ``rollout.lookup_recipe.WarmStartConfig`` (default: the local RL recipe).
        style: tokenizer / chat style (``token``: the token format; ``chatml_tiny`` /
            ``chatml`` / ``llama3``: the template format with the model's tool calls).

    Returns:
        The model directory ``root/policy-seed{seed}-{key}`` (HF and vLLM load it; the
        tokenizer is saved with it; :data:`REPORT` holds the warm start's scores).

    Raises:
        rollout.lookup_recipe.WarmStartFailed: the warm start did not take (nothing is cached).
    """
    from ray_xlong.rollout.lookup_recipe import WarmStartConfig

    warm = warm or WarmStartConfig()
    tag = "" if style == "token" else f"-{style}"
    path = pathlib.Path(root) / f"policy-seed{seed}{tag}-{warm_start_key(warm)}"
    if (path / READY_MARKER).exists():
        return str(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.parent / f".{path.name}.lock", "w") as lock:   # one builder per cache entry
        fcntl.flock(lock, fcntl.LOCK_EX)    # (drivers or test workers sharing the cache)
        if (path / READY_MARKER).exists():
            return str(path)
        return _build_warm_started(path, seed=seed, warm=warm, style=style)


def _build_warm_started(path: pathlib.Path, *, seed: int, warm, style: str) -> str:
    from ray_xlong.models import build_tiny_model_dir
    from ray_xlong.rollout.formats import format_for_tokenizer
    from ray_xlong.rollout.lookup_recipe import format_corpus, warm_start_policy

    reports = []

    def train(model, tokenizer):
        reports.append(warm_start_policy(model, format_for_tokenizer(tokenizer), warm,
                                         seed=seed))

    out = pathlib.Path(build_tiny_model_dir(path, seed=seed, train=train, style=style,
                                            extra_texts=format_corpus(style)))
    report = dataclasses.asdict(reports[0])
    report["losses"] = [round(x, 5) for x in report["losses"]]
    (out / REPORT).write_text(json.dumps(report, indent=1) + "\n")
    (out / READY_MARKER).write_text("ok\n")
    return str(out)


def warm_start_key(warm) -> str:
    """Cache key of a warm start: its recipe version and every config field (8 hex digits)."""
    text = f"{WARM_START_VERSION}:{dataclasses.asdict(warm)}"
    return hashlib.sha256(text.encode()).hexdigest()[:8]
