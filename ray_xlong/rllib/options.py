"""``XLongOptions``: what RLlib has no word for, set through ``XLongConfig.xlong(...)`` — cells,
mode, staleness, engine, the task (a registered name or a factory), run budgets — with the
defaults for a real 1.5B–8B policy (:data:`AGENT_HARNESS`, :data:`AGENT_LR`) and the tiny lookup
recipe's (:data:`RECIPE_HARNESS`, :data:`RECIPE_LR`). Validated at construction; errors name
the field. ``XLongConfig`` itself lives beside its algorithm (``rllib/algorithm.py``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable


from ray_xlong.cells.learner_settings import ATTENTIONS
from ray_xlong.cells.sharding import ShardingSettings
from ray_xlong.rollout.engine_settings import EngineSettings
from ray_xlong.checks import is_int as _is_int
from ray_xlong.rollout import HarnessConfig
from ray_xlong.rollout.tasks import TaskFactory
from ray_xlong.scheduling.modes import CELL_MODES as MODES  # the one mode registry
from ray_xlong.trajectory import LossConfig

ENGINES = ("hf", "vllm")
"""Valid ``XLongOptions.engine`` values."""
RECIPE_HARNESS = HarnessConfig(max_new_tokens=8, max_calls=4, max_retries=1)
"""Run budgets of the tiny lookup recipe (``benchmarks/tools/local_rl.py``: ``LocalRLConfig.harness``): demos and
tests on tiny CPU models set it explicitly (:meth:`XLongConfig.lookup_recipe`)."""
RECIPE_LR = 5e-4
"""Learning rate of the tiny lookup recipe."""
AGENT_HARNESS = HarnessConfig(
    max_new_tokens=2048, context_capacity=32768, compaction_budget=24576,
    summary_max_tokens=1024, max_run_tokens=65536, max_calls=64,
    max_tool_output_tokens=4096, wall_clock_s=3600.0, tool_timeout_s=120.0,
    score_timeout_s=600.0)
"""Default run budgets (``XLongOptions.harness``): what a 1.5B–8B tool-using agent with a 32k
context starts from (``docs/own-task.md`` has the table and the reasons)."""
AGENT_LR = 1e-6
"""Default learning rate (``XLongConfig.lr``) for full fine-tuning of a 1.5B–8B policy."""


@dataclasses.dataclass(frozen=True, slots=True)
class XLongOptions:
    """What ``.xlong(...)`` sets (each field validated at construction)."""

    mode: str = "elastic"
    """One of :data:`MODES`: how cells change role."""
    cells: int | None = None
    """Cells (None: ``num_env_runners``, or 2 when that is 0)."""
    nodes_per_cell: int = 1
    """Bundles (nodes) per cell."""
    cpus_per_cell: float | None = None
    """CPUs of a cell's bundle (None: ``num_cpus_per_env_runner``)."""
    gpus_per_node: int | None = None
    """(Logical) GPUs per bundle (None: ``num_gpus_per_env_runner``, at least 1)."""
    placement_strategy: str = "STRICT_SPREAD"
    """Placement strategy of a cell's bundles (``PACK`` on one machine)."""
    slots_per_cell: int = 64
    """Runs one rollout cell serves at once (its engine's batch)."""
    async_rollout_cells: int = 1
    """Rollout pool size of the async modes."""
    runs_per_group: int = 8
    """GRPO group size (runs of one task instance)."""
    max_trajectories_per_run: int = 5
    """K: trajectories kept per run."""
    staleness_bound: int = 1
    """Max (step that trains a group) − (version its runs started with)."""
    micro_batch_tokens: int = 8192
    """Token budget of one micro-batch sent to a training cell."""
    engine: str = "hf"
    """Inference backend of rollout cells: ``hf`` | ``vllm``."""
    task: str | TaskFactory = "lookup"
    """The task every run does: a registered name (built in, or ``register_task``-ed in this
    process: its factory goes to every cell) or a factory ``make(seed) -> TaskEnv`` itself
    (picklable; ``DatasetTask`` is one). With ``agent_task``: the external agent's name."""
    task_factory: TaskFactory | None = None
    """Resolved from ``task`` (do not set): the factory sent to the cells for a task that is
    not built in, so that a config pickled to another process (Tune) still carries it."""
    eval_task: str | TaskFactory | None = None
    """Held-out task of RLlib's ``.evaluation(...)`` rounds (name or factory, e.g. the eval
    part of ``DatasetTask.split``); None: ``task`` on seeds training never draws."""
    eval_task_factory: TaskFactory | None = None
    """Resolved from ``eval_task`` (do not set), as ``task_factory``."""
    eval_samples: int | None = None
    """Runs per held-out instance in evaluation (k of pass@k; None: ``runs_per_group``)."""
    eval_pass_threshold: float = 1.0
    """An evaluation run passes (for pass@k) when its reward is at least this."""
    agent_task: Callable[[int], Any] | None = None
    """An external agent as the task: ``make(seed) -> ray_xlong.serving.agents.AgentTask``
    (picklable), registered as ``task`` in every runner; each run is opened on the endpoint of
    the cell it starts on and the agent gets that cell's base URL. None: a built-in task."""
    model_dir: str | None = None
    """Policy directory (model + tokenizer); ``rl_module(model_config={"model_dir": ...})``
    overrides it. Required to build."""
    dtype: str = "float32"
    """Weight dtype of the Learners and the engines (``float32`` | ``bfloat16``): both load
    the same weights."""
    loss: LossConfig = LossConfig()
    """Token loss (PPO clip ε low/high, or TIS)."""
    pack: str = "tree"
    """``tree`` | ``per_trajectory`` packing of training batches."""
    normalize_std: bool = True
    """Divide group advantages by the group reward std."""
    sharding: ShardingSettings = ShardingSettings()
    """A training cell's Learner ranks: ``ranks_per_cell``, ``device`` (``cpu`` | ``cuda``),
    mixed precision, activation checkpointing, memory per rank (``cells/sharding.py``). Each
    rank holds its bundle's GPUs in Ray (``gpus_per_node`` ÷ ranks per bundle); default: one
    Learner per cell on CPU."""
    engine_settings: EngineSettings = EngineSettings()
    """The rollout engines' long-context settings (``rollout/engine_settings.py``):
    ``max_model_len`` (default: the model's own), ``tensor_parallel_size``, CUDA graphs on GPU
    (``enforce_eager``), prefix caching, GPU memory share."""
    context_parallel: int = 1
    """Ranks per tree row (``LearnerSettings.context_parallel``): divides
    ``sharding.ranks_per_cell``; needs ``pack='tree'``."""
    attn_implementation: str | None = None
    """How the Learner's model attends (``LearnerSettings.attn_implementation``; None: by
    batch layout)."""
    harness: HarnessConfig = AGENT_HARNESS
    """Per-run budgets (tokens, calls, context, wall clock); default :data:`AGENT_HARNESS`."""
    max_steps: int = 100_000
    """Length of the scheduler's job (``train()`` may be called at most this often)."""
    poll_s: float = 0.2
    """Longest the driver waits for an actor report before deciding again."""
    spool_dir: str | None = None
    """Where runners spool ended runs before handing them over (storage every node sees):
    with it a lost runner loses no finished run (``ray_xlong/cells/spool.py``). Runner,
    learner and node losses are recovered with or without it."""

    def __post_init__(self) -> None:
        _check(self.mode in MODES, "mode", f"one of {MODES}", self.mode)
        _check(self.engine in ENGINES, "engine", f"one of {ENGINES}", self.engine)
        _check(self.pack in ("tree", "per_trajectory"), "pack", "'tree' or 'per_trajectory'",
               self.pack)
        for name in ("nodes_per_cell", "slots_per_cell", "async_rollout_cells",
                     "runs_per_group", "max_trajectories_per_run", "micro_batch_tokens",
                     "max_steps"):
            value = getattr(self, name)
            _check(_is_int(value) and value >= 1, name, "an int >= 1", value)
        _check(_is_int(self.staleness_bound) and self.staleness_bound >= 0, "staleness_bound",
               "an int >= 0", self.staleness_bound)
        _check(self.cells is None or (_is_int(self.cells) and self.cells >= 1), "cells",
               "None or an int >= 1", self.cells)
        _check(self.cpus_per_cell is None or self.cpus_per_cell > 0, "cpus_per_cell",
               "None or > 0", self.cpus_per_cell)
        _check(self.gpus_per_node is None or (_is_int(self.gpus_per_node)
                                              and self.gpus_per_node >= 0),
               "gpus_per_node", "None or an int >= 0", self.gpus_per_node)
        _check(self.model_dir is None or (isinstance(self.model_dir, str) and self.model_dir),
               "model_dir", "None or a path string", self.model_dir)
        _check(isinstance(self.loss, LossConfig), "loss", "a LossConfig", self.loss)
        _check(isinstance(self.sharding, ShardingSettings), "sharding", "a ShardingSettings",
               self.sharding)
        _check(isinstance(self.engine_settings, EngineSettings), "engine_settings",
               "an EngineSettings", self.engine_settings)
        _check(_is_int(self.context_parallel) and self.context_parallel >= 1,
               "context_parallel", "an int >= 1", self.context_parallel)
        _check(self.attn_implementation is None or self.attn_implementation in ATTENTIONS,
               "attn_implementation", f"None or one of {ATTENTIONS}", self.attn_implementation)
        _check(isinstance(self.harness, HarnessConfig), "harness", "a HarnessConfig",
               self.harness)
        _check(self.poll_s > 0, "poll_s", "> 0", self.poll_s)
        from ray_xlong.rollout.tasks import TASKS

        _check(self.eval_samples is None or (_is_int(self.eval_samples)
                                             and self.eval_samples >= 1),
               "eval_samples", "None or an int >= 1", self.eval_samples)
        if self.eval_task is not None:
            object.__setattr__(self, "eval_task_factory",
                               _resolve_task(self.eval_task, self.eval_task_factory,
                                             field="eval_task"))
        if self.agent_task is None:
            object.__setattr__(self, "task_factory", _resolve_task(self.task,
                                                                   self.task_factory))
        else:
            _check(callable(self.agent_task), "agent_task", "make(seed) -> AgentTask",
                   self.agent_task)
            _check(isinstance(self.task, str) and bool(self.task) and self.task not in TASKS,
                   "task", f"a new name for the external agent (not one of {sorted(TASKS)})",
                   self.task)


    @property
    def task_name(self) -> str:
        """The name runs carry (``RunSpec.task``): ``task``, or a factory's name."""
        return task_name(self.task)

    @property
    def eval_task_name(self) -> str:
        """The evaluation task's name (``task_name`` when ``eval_task`` is None)."""
        return self.task_name if self.eval_task is None else task_name(self.eval_task)


def task_name(task: Any) -> str:
    """The name of a task given by name or by factory (a factory's ``name`` attribute when it
    has one, else its qualified name, e.g. ``my_script.MyTask``)."""
    if isinstance(task, str):
        return task
    name = getattr(task, "name", None)
    if isinstance(name, str) and name:
        return name
    kind = task if isinstance(task, type) or hasattr(task, "__qualname__") else type(task)
    return f"{kind.__module__}.{kind.__qualname__}"


def _resolve_task(task: Any, resolved: Any, *, field: str = "task") -> Any:
    """The factory to send to the cells for ``task`` (None for a built-in task)."""
    from ray_xlong.rollout.tasks import BUILTIN_TASKS, TASKS

    if isinstance(task, str):
        if task in BUILTIN_TASKS:
            return None
        if task in TASKS:
            return TASKS[task]
        _check(resolved is not None, field, f"a registered task name (one of {sorted(TASKS)}; "
               f"register_task(name, factory) first) or a factory make(seed) -> TaskEnv", task)
        return resolved
    _check(callable(task), field, "a registered task name or a factory make(seed) -> TaskEnv",
           task)
    name = task_name(task)
    _check(name not in BUILTIN_TASKS or BUILTIN_TASKS[name] is task, field,
           f"a factory whose name is not a built-in task's ({sorted(BUILTIN_TASKS)})", name)
    return None if name in BUILTIN_TASKS else task


def _check(ok: bool, field: str, want: str, got: Any) -> None:
    if not ok:
        raise ValueError(f"XLongOptions.{field} must be {want}, got {got!r}")
