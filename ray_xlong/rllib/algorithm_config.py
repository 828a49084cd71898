"""``XLongConfig``: the RLlib ``AlgorithmConfig`` of an xlong training job, with ``.xlong(...)``.

RLlib's builders keep their meaning; what RLlib has no word for goes through ``.xlong``::

    XLongConfig()
      .training(lr=1e-6, grad_clip=1.0, train_batch_size_per_learner=128)  runs per step
      .env_runners(num_env_runners=2, num_cpus_per_env_runner=1.0,        cells (one engine
                   num_gpus_per_env_runner=1)                             runner + learner each)
      .callbacks(MyCallbacks)                                             on_algorithm_init,
                                                                          on_train_result …
      .rl_module(model_config={"model_dir": ..., "dtype": "float32"})     the HF causal LM
      .debugging(seed=0)
      .xlong(mode="elastic", runs_per_group=8, staleness_bound=1, engine="vllm",
             task=MyTask, eval_task="my_eval")                            own task: a name
                                                                          or a factory
      .evaluation(evaluation_interval=5, evaluation_duration=32)          held-out rounds
      .build_algo()                                                       -> XLongAlgorithm

The defaults (lr 1e-6, :data:`AGENT_HARNESS`: 2048 tokens a call, 64 calls a run, a 32k
context) are for a real 1.5B–8B policy; :meth:`XLongConfig.lookup_recipe` sets the tiny lookup
recipe's (lr 5e-4, 8 tokens a call, 4 calls) for demos and tests on tiny CPU models.

One episode is one agent run, so batch sizes count runs: a step trains
``total_train_batch_size`` runs = ``groups`` × ``runs_per_group`` (must divide). Cells come from
``num_env_runners`` (a cell hosts one rollout runner and one Learner; ``num_learners`` stays 0:
the elastic learner group owns the Learners) or ``.xlong(cells=...)``; setting both to
different numbers is an error. :meth:`XLongConfig.job_config` combines everything into the
cell layer's job record (``config.CellJobConfig``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from ray.rllib.algorithms.algorithm_config import AlgorithmConfig, NotProvided

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


class XLongConfig(AlgorithmConfig):
    """AlgorithmConfig of :class:`~ray_xlong.rllib.algorithm.XLongAlgorithm` (module doc)."""

    def __init__(self, algo_class: type | None = None) -> None:
        from ray_xlong.rllib.algorithm import XLongAlgorithm

        super().__init__(algo_class=algo_class or XLongAlgorithm)
        # Defaults for a 1.5B–8B agent: lr, clip, 16 groups × 8 runs per step (the tiny
        # lookup recipe sets its own: lookup_recipe()).
        self.lr = AGENT_LR
        self.grad_clip = 1.0
        self.train_batch_size_per_learner = 128
        self.train_batch_size = 128
        self.xlong_options = XLongOptions()

    def xlong(self, *, mode: str = NotProvided, cells: int = NotProvided,
              nodes_per_cell: int = NotProvided, cpus_per_cell: float = NotProvided,
              gpus_per_node: int = NotProvided, placement_strategy: str = NotProvided,
              slots_per_cell: int = NotProvided, async_rollout_cells: int = NotProvided,
              runs_per_group: int = NotProvided, max_trajectories_per_run: int = NotProvided,
              staleness_bound: int = NotProvided, micro_batch_tokens: int = NotProvided,
              engine: str = NotProvided, task: str | TaskFactory = NotProvided,
              agent_task: Callable[[int], Any] = NotProvided,
              eval_task: str | TaskFactory | None = NotProvided,
              eval_samples: int | None = NotProvided,
              eval_pass_threshold: float = NotProvided, model_dir: str = NotProvided,
              dtype: str = NotProvided, loss: LossConfig = NotProvided, pack: str = NotProvided,
              normalize_std: bool = NotProvided, harness: HarnessConfig = NotProvided,
              max_steps: int = NotProvided, poll_s: float = NotProvided,
              spool_dir: str = NotProvided) -> "XLongConfig":
        """Set xlong options (fields of :class:`XLongOptions`; validated here). Returns self."""
        given = {k: v for k, v in locals().items() if k != "self" and v is not NotProvided}
        for name in ("task", "eval_task"):
            if name in given:
                given[f"{name}_factory"] = None     # resolved again from the new task
        self.xlong_options = dataclasses.replace(self.xlong_options, **given)
        return self

    def lookup_recipe(self) -> "XLongConfig":
        """The tiny lookup recipe's lr and run budgets (:data:`RECIPE_LR`,
        :data:`RECIPE_HARNESS`) instead of the real-model defaults: for demos and tests on
        tiny CPU models. Returns self."""
        return self.training(lr=RECIPE_LR).xlong(harness=RECIPE_HARNESS)

    # -- what the options resolve to -----------------------------------------------------------
    @property
    def num_cells(self) -> int:
        """Cells of the job (``.xlong(cells)`` or ``num_env_runners`` or 2)."""
        opt = self.xlong_options
        if opt.cells is not None and self.num_env_runners not in (0, opt.cells):
            raise ValueError(f"XLongConfig: xlong(cells={opt.cells}) and env_runners("
                             f"num_env_runners={self.num_env_runners}) disagree (a cell hosts "
                             f"one env runner)")
        return opt.cells or self.num_env_runners or 2

    @property
    def groups_per_step(self) -> int:
        """Groups a step trains: ``total_train_batch_size`` runs ÷ ``runs_per_group``."""
        runs, r = int(self.total_train_batch_size), self.xlong_options.runs_per_group
        if runs < r or runs % r:
            raise ValueError(f"XLongConfig.train_batch_size_per_learner ({runs} runs per step) "
                             f"must be a multiple of xlong(runs_per_group={r})")
        return runs // r

    @property
    def policy_model_dir(self) -> str:
        """The policy directory (``rl_module(model_config)`` first, then ``.xlong``)."""
        cfg = self.model_config if isinstance(self.model_config, dict) else {}
        path = cfg.get("model_dir") or self.xlong_options.model_dir
        if not path:
            raise ValueError("XLongOptions.model_dir: no policy directory (set .xlong("
                             "model_dir=...) or .rl_module(model_config={'model_dir': ...}))")
        return str(path)

    def validate(self) -> None:
        super().validate()
        if self.num_learners:
            raise ValueError(f"XLongConfig.num_learners must be 0 (each cell hosts its own "
                             f"Learner; set cells instead), got {self.num_learners}")
        if self.grad_clip_by != "global_norm" and self.grad_clip is not None:
            raise ValueError(f"XLongConfig.grad_clip_by must be 'global_norm', "
                             f"got {self.grad_clip_by!r}")
        self._validate_evaluation()
        self.job_config(group_offset=0)

    def _validate_evaluation(self) -> None:
        """RLlib's evaluation settings xlong runs (``rllib/evaluation.py``)."""
        if not self.evaluation_interval:
            return
        duration, unit = self.evaluation_duration, self.evaluation_duration_unit
        if not (_is_int(duration) and duration >= 1):
            raise ValueError(f"XLongConfig.evaluation_duration must be an int >= 1 (held-out "
                             f"instances per round), got {duration!r}")
        if unit != "episodes":
            raise ValueError(f"XLongConfig.evaluation_duration_unit must be 'episodes' (an "
                             f"episode is a run), got {unit!r}")
        if self.xlong_options.agent_task is not None and self.xlong_options.eval_task is None:
            raise ValueError("XLongConfig.evaluation_interval: evaluating an external agent "
                             "task is not supported; set xlong(eval_task=...) to a task")

    def job_config(self, *, group_offset: int):
        """The cell layer's job record (``ray_xlong.cells.config.XLongConfig``)."""
        from ray_xlong.cells.pool import CellLayout
        from ray_xlong.cells.config import CellJobConfig
        from ray_xlong.cells.config import LearnerSettings
        from ray_xlong.cells.task_job import TaskJob
        from ray_xlong.scheduling import SchedulingConfig
        from ray_xlong.trajectory import ProcessorConfig

        opt = self.xlong_options
        cpus = opt.cpus_per_cell or float(self.num_cpus_per_env_runner or 1)
        gpus = opt.gpus_per_node if opt.gpus_per_node is not None else max(
            int(self.num_gpus_per_env_runner or 0), 1)
        cfg = self.model_config if isinstance(self.model_config, dict) else {}
        learner = LearnerSettings(model_dir=self.policy_model_dir, lr=float(self.lr),
                                  loss=opt.loss, dtype=cfg.get("dtype", opt.dtype),
                                  micro_batch_tokens=opt.micro_batch_tokens,
                                  grad_clip=self.grad_clip)
        return CellJobConfig(
            mode=opt.mode,
            job=SchedulingConfig(opt.max_steps, self.groups_per_step, opt.runs_per_group,
                                 opt.staleness_bound),
            layout=CellLayout(cells=self.num_cells, nodes_per_cell=opt.nodes_per_cell,
                              gpus_per_node=gpus, cpus_per_bundle=cpus,
                              strategy=opt.placement_strategy),
            learner=learner, slots_per_cell=opt.slots_per_cell,
            async_rollout_cells=opt.async_rollout_cells,
            work=TaskJob(opt.task_name, seed=int(self.seed or 0), group_offset=group_offset,
                         agent=opt.agent_task, factory=opt.task_factory),
            harness=opt.harness,
            processor=ProcessorConfig(max_trajectories_per_run=opt.max_trajectories_per_run,
                                      pack=opt.pack, normalize_std=opt.normalize_std),
            poll_s=opt.poll_s, spool_dir=opt.spool_dir)
