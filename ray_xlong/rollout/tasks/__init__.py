"""Tasks: the interface (``base.py``) and a registry of the built-in tasks.

``lookup`` is the learnable task (RL climbs it within ~30 steps; see ``lookup.py``).
``dataset.py``: tasks whose instances are the rows of a JSONL / parquet / HF dataset.
``make_task(name, seed=...)`` builds a :class:`TaskEnv`; an unknown name raises
:class:`UnknownTaskError` listing the known ones. ``register_task`` adds a factory.
"""

from __future__ import annotations

from ray_xlong.rollout.tasks.arithmetic import ArithmeticTask
from ray_xlong.rollout.tasks.base import (Observation, TaskEnv, TaskFactory, TaskFailure,
                                         ToolError, UnknownTaskError)
from ray_xlong.rollout.tasks.code import CodeTask
from ray_xlong.rollout.tasks.dataset import (DataPosition, DatasetRowError, DatasetTask,
                                            PromptEnv, exact_match)
from ray_xlong.rollout.tasks.long_horizon import LongHorizonConfig, LongHorizonTask
from ray_xlong.rollout.tasks.lookup import LookupTask

TASKS: dict[str, TaskFactory] = {
    "arithmetic": ArithmeticTask,
    "code": CodeTask,
    "long_horizon": LongHorizonTask,
    "lookup": LookupTask,
}
"""Registered tasks, by name."""
BUILTIN_TASKS: dict[str, TaskFactory] = dict(TASKS)
"""The tasks every process knows (a task registered at run time reaches the cells through the
config: ``.xlong(task=...)`` sends its factory)."""


def register_task(name: str, factory: TaskFactory) -> None:
    """Register ``factory`` (``seed -> TaskEnv``) under ``name`` (must be new)."""
    if not isinstance(name, str) or not name or name in TASKS:
        raise ValueError(f"register_task: name must be a new non-empty string, got {name!r}")
    TASKS[name] = factory


def make_task(name: str, *, seed: int) -> TaskEnv:
    """A fresh instance of task ``name``."""
    if name not in TASKS:
        raise UnknownTaskError(f"unknown task {name!r}; known tasks: {sorted(TASKS)}")
    return TASKS[name](seed)


__all__ = ["BUILTIN_TASKS", "ArithmeticTask", "CodeTask", "DataPosition", "DatasetRowError",
           "DatasetTask", "LongHorizonConfig", "LongHorizonTask", "LookupTask", "Observation",
           "PromptEnv", "TASKS", "TaskEnv", "TaskFactory", "TaskFailure", "ToolError",
           "UnknownTaskError", "exact_match", "make_task", "register_task"]
