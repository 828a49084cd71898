"""``XLongAlgorithm``: an RLlib ``Algorithm`` whose ``training_step`` drives cells through the
scheduler — one optimizer step per call.

```
setup(config)           cells up once (placement groups; runner + Learner per cell); callbacks
training_step()         first call: SteppingActuator.start() (weights of the start version)
                        every call: actuator.advance() → StepReport → self.metrics (RLlib keys)
train()                 RLlib's: training_step, compile metrics, on_train_result callbacks
save_to_path(p)         a Learner holding the current version writes its own DCP checkpoint
                        to p/learner (weights + Adam moments, each rank its shards:
                        ``cells/shard_checkpoint.py``, the format of the job checkpoints);
                        the driver pickles only p/learner's name, the version, the data
                        position and training_iteration; the config (pickled, by RLlib)
restore_from_path(p)    into an algorithm that has not trained yet: the first training_step
                        has every cell's Learner load p/learner (same version, same iteration)
export_hf(p)            a Learner holding the current version writes a Hugging Face directory
                        (safetensors, config, tokenizer + chat template, generation config;
                        ``models/export.py``); no tensor passes through the driver
from_checkpoint(p)      a new algorithm from the saved config (or config=), then restored
stop()                  actors and placement groups go
```

Result keys: ``env_runners/episode_return_mean`` (mean reward of the runs the step trained),
``env_runners/num_episodes``, and ``xlong/<StepReport field>`` (``policy_version``,
``tokens_trained``, ``unique_tokens``, ``total_tokens``, ``trajectories_kept`` / ``_dropped``,
``staleness_max``, ``cells_<role>``, ``gpu_busy_frac``, ``step_s``, ``elapsed_s``, ``runs``).
They are nested dicts of the ``train()`` result, so Tune's loggers write them as RLlib users
expect: ``tune.Tuner(XLongAlgorithm, param_space=config)`` → ``progress.csv`` columns
``xlong/tokens_trained``…, ``result.json`` lines, and TensorBoard scalars
``ray/tune/xlong/tokens_trained``… in the trial directory. Under Tune the trial reserves only
the driver process (:meth:`XLongAlgorithm.default_resource_request`): the cells are placement
groups the algorithm creates itself.

Limits (said, not hidden): a checkpoint holds the trained state, not runs in flight or ended
runs not trained yet (they are re-sampled after a restore, from the saved task position
``xlong/data_position``). RLlib's ``.evaluation(...)`` runs on evaluation runners beside the
cells (``rllib/evaluation.py``), results under ``evaluation/env_runners/...``. The Learner
connector pipeline is: each training cell's XLongLearner runs the user's learner connector
pieces, then ``PrefixTreeConnector`` (RLlib's order), on the episodes of the runs it trains
(``XLongLearner.accumulate_runs``).
"""

from __future__ import annotations

import collections
import dataclasses
import os
import pathlib
import pickle
from typing import Any, Callable

import ray
from ray.rllib.algorithms.algorithm import Algorithm
from ray.rllib.algorithms.algorithm_config import AlgorithmConfig, NotProvided
from ray.rllib.callbacks.utils import make_callback
from ray.rllib.utils import force_list
from ray.rllib.utils.checkpoints import Checkpointable
from ray.rllib.utils.debug import update_global_seed_if_necessary
from ray.tune.execution.placement_groups import PlacementGroupFactory

from ray_xlong.cells.ray_edge import KEEP_TASK_WORKERS
from ray_xlong.checks import is_int as _is_int
from ray_xlong.rllib import results as rx_results
from ray_xlong.rllib.evaluation import attach as attach_evaluation, eval_tasks
from ray_xlong.rllib.options import (AGENT_LR, RECIPE_HARNESS, RECIPE_LR, XLongOptions)
from ray_xlong.cells.sharding import ShardingSettings
from ray_xlong.cells.stepping import StepReport, SteppingActuator
from ray_xlong.rollout import HarnessConfig
from ray_xlong.rollout.engine_settings import EngineSettings
from ray_xlong.rollout.tasks import TaskFactory
from ray_xlong.trajectory import LossConfig

XLONG = "xlong"
"""Result key of the xlong metrics."""
STEP_METRICS = ("policy_version", "tokens_trained", "unique_tokens", "total_tokens",
                "trajectories_kept", "trajectories_dropped", "staleness_max", "gpu_busy_frac",
                "step_s", "elapsed_s", "runs")
"""``result["xlong"][name]`` of every step (:class:`StepReport` fields; ``policy_version`` is
``StepReport.version``), besides ``cells_<role>`` per role."""
TRAINING_ITERATION = "training_iteration"
LEARNER_DIR = "learner"
"""The Learner's DCP checkpoint inside a ``save_to_path`` directory."""


class XLongAlgorithm(Algorithm):
    """See the module docstring."""

    @classmethod
    def get_default_config(cls) -> XLongConfig:
        return XLongConfig(cls)

    @classmethod
    def default_resource_request(cls, config) -> PlacementGroupFactory:
        """What a Tune trial reserves: the driver process only. The cells (runner + Learner
        each) are placement groups ``setup`` creates, so RLlib's env-runner and learner
        bundles would reserve the same resources twice."""
        if not isinstance(config, AlgorithmConfig):
            config = cls.get_default_config().update_from_dict(config)
        return PlacementGroupFactory([{"CPU": config.num_cpus_for_main_process,
                                       **config.custom_resources_for_main_process}])

    def setup(self, config: XLongConfig) -> None:
        """Cells up, callbacks made, ``on_algorithm_init`` fired (no RLlib EnvRunnerGroup:
        the cells' runners are the env runners)."""
        from ray_xlong.cells.pool import create_cells
        from ray_xlong.rllib.cell_actors import cell_actors
        from ray_xlong.rllib.env_runner import RolloutConfig

        update_global_seed_if_necessary("torch", self.config.seed)
        self.callbacks = [cls() for cls in force_list(self.config.callbacks_class)]
        self.local_replay_buffer, self.offline_data = None, None
        self.remote_requests_in_flight = collections.defaultdict(set)
        self.env_runner_group, self.spaces = None, None
        self.env_to_module_connector = self.module_to_env_connector = None
        self.evaluation_config = self.config.get_evaluation_config_object()
        self.eval_env_runner_group = None        # evaluation on the cells: evaluation.py
        self._evaluation = None
        self._aggregator_actor_manager = None
        self._set_up_metrics()
        self.job = self.config.job_config(group_offset=0)
        _ensure_ray(self.job.layout)
        opt = self.config.xlong_options
        rollout = RolloutConfig(model_dir=self.job.learner.model_dir, backend=opt.engine,
                                harness=opt.harness, max_batch_size=opt.slots_per_cell,
                                seed=int(self.config.seed or 0), dtype=self.job.learner.dtype,
                                engine_settings=opt.engine_settings)
        actors = cell_actors(rollout=rollout, learner=self.job.learner,
                             processor=self.job.processor, seed=int(self.config.seed or 0),
                             spool_dir=self.job.spool_dir,
                             tasks={**self.job.work.tasks(), **eval_tasks(opt)},
                             agent_tasks=self.job.work.agent_tasks(),
                             learner_connector=self.config._learner_connector,
                             sharding=self.job.sharding)
        self.pool = create_cells(self.job.layout, actors=actors)
        self.actuator: SteppingActuator | None = None
        self.policy_version = 0
        self._start_state: dict[str, Any] | None = None
        self._data_position: int | None = None     # restored: the next group index
        self.reports: list[StepReport] = []
        self._start_dir: str | None = None         # restored: the Learner checkpoint
        self._restore_path: str | None = None
        self._start_loaded = False
        make_callback("on_algorithm_init", self.callbacks,
                      self.config.callbacks_on_algorithm_init,
                      kwargs=dict(algorithm=self, metrics_logger=self.metrics))

    # -- training ------------------------------------------------------------------------------
    def training_step(self) -> None:
        """One optimizer step on the cells; metrics go to ``self.metrics``."""
        if self.actuator is None:
            self.actuator = self._start_actuator()
            attach_evaluation(self)
        report = self.actuator.advance()
        self.policy_version = report.version
        self.reports.append(report)
        self._log(report)

    def _start_actuator(self) -> SteppingActuator:
        from ray_xlong.cells.config import make_policy

        version = self.policy_version
        offset = (self._data_position if self._data_position is not None
                  else version * self.config.groups_per_step)
        self._group_offset, self._start_version = offset, version
        job = self.config.job_config(group_offset=offset)
        if self._start_dir is not None:
            ray.get([c.learner.load_checkpoint.remote(self._start_dir) for c in self.pool.cells])
            lead = self.pool.cells[0].learner
            state_ref, weights_ref = lead.get_xlong_state.remote(), lead.get_weights.remote()
        elif self._start_state is None:
            state_ref, weights_ref = self.pool.initial_state, self.pool.initial_weights
        else:
            state_ref = ray.put(self._start_state)
            weights_ref = ray.put(self._start_state["weights"])
        actuator = SteppingActuator(job, make_policy(job), self.pool, version=version,
                                    state_ref=state_ref, weights_ref=weights_ref)
        actuator.start()
        return actuator

    def _log(self, report: StepReport) -> None:
        """RLlib's standard keys (``results.py``) and the ``xlong/`` ones."""
        m = self.metrics
        learner = rx_results.learner_metrics(rx_results.collect_learner_stats(
            self.actuator.learners.learners, version=report.version - 1))
        finish = self.actuator.actuator.stats.get("step_finish_s") or [0.0]
        rx_results.log_step(m, report=report, learner=learner,
                            agent=report.agent,
                            times=rx_results.step_times(step_s=report.step_s, learner=learner,
                                                        finish_s=finish[-1]))
        m.log_value((XLONG, "policy_version"), report.version, window=1)
        for name in STEP_METRICS[1:]:
            m.log_value((XLONG, name), getattr(report, name), window=1)
        for role, count in report.cells_by_role.items():
            m.log_value((XLONG, f"cells_{role}"), count, window=1)

    def _compile_iteration_results(self, *, train_results, eval_results):
        """RLlib's, plus the blocks its result checks expect (``results.complete``): cells
        are the env runners of ``fault_tolerance``."""
        out = super()._compile_iteration_results(train_results=train_results,
                                                 eval_results=eval_results)
        act = self.actuator.actuator if self.actuator is not None else None
        fault = rx_results.fault_tolerance(
            cells=self.job.layout.cells, retired=len(act.retired) if act else 0,
            recoveries=sum(f.kind != "node_returned" for f in act.faults) if act else 0)
        return rx_results.complete(out, fault=fault)

    def restore_env_runners(self, env_runner_group) -> list:
        """No RLlib EnvRunnerGroup to repair (a dead cell actor raises ``CellActorDied``)."""
        return []

    def events(self) -> list:
        """The event log of the job so far (simulator format; for ``plot_timelines``)."""
        return list(self.actuator.m.log) if self.actuator else []

    # -- checkpoints -----------------------------------------------------------------------------
    def get_state(self, components=None, *, not_components=None, **kwargs) -> dict[str, Any]:
        """Where the Learner checkpoint goes (``learner_dir``, relative to the checkpoint
        path), the version, the data position and ``training_iteration``: no tensors (the
        Learner writes its own state, :meth:`save_to_path`)."""
        return {XLONG: {"learner_dir": LEARNER_DIR, "policy_version": self.policy_version,
                        "data_position": self.data_position},
                TRAINING_ITERATION: self.training_iteration}

    def _holder(self) -> Any:
        """A Learner actor holding the current version's state (loading the restored
        checkpoint into cell 0's first when the algorithm has not trained yet)."""
        if self.actuator is not None:
            g = self.actuator.learners
            holders = g.holders()
            cell = g.lead if g.lead in holders else holders[0]
            return g.learners[cell]
        lead = self.pool.cells[0].learner
        if not self._start_loaded:
            if self._start_dir is not None:
                ray.get(lead.load_checkpoint.remote(self._start_dir))
            elif self._start_state is not None:
                ray.get(lead.set_xlong_state.remote(self._start_state))
            self._start_loaded = True
        return lead

    def save_to_path(self, path=None, *, state=None, filesystem=None, use_msgpack=False) -> str:
        """A Learner holding the current version writes ``path/learner`` (a DCP checkpoint,
        blocking), then RLlib writes the small state and the config."""
        import tempfile

        root = pathlib.Path(path) if path is not None else pathlib.Path(tempfile.mkdtemp())
        root.mkdir(parents=True, exist_ok=True)
        ray.get(self._holder().save_checkpoint.remote(str(root / LEARNER_DIR), None, True))
        return super().save_to_path(str(root), state=state, filesystem=filesystem,
                                    use_msgpack=use_msgpack)

    def export_hf(self, path: str | os.PathLike) -> str:
        """Write the current policy as a Hugging Face directory at ``path`` (module
        docstring): ``AutoModelForCausalLM.from_pretrained(path)`` and the vLLM engine load it,
        with the Learner's weights bit for bit. Written by a Learner (rank 0 of a sharded
        cell, gathering tensor by tensor). Returns ``path``."""
        return ray.get(self._holder().export_hf.remote(str(pathlib.Path(path).resolve())))

    @property
    def data_position(self) -> int:
        """The task stream's position: the global index of the next group to draw after the
        groups trained so far (what a restored job continues from; groups in flight at a
        save are drawn again)."""
        if self.actuator is not None:
            trained = self.policy_version - self._start_version
            return self._group_offset + trained * self.config.groups_per_step
        if self._data_position is not None:
            return self._data_position
        return self.policy_version * self.config.groups_per_step

    def set_state(self, state: dict[str, Any]) -> None:
        """Load :meth:`get_state` output (only before the first ``training_step``)."""
        if self.actuator is not None:
            raise RuntimeError("XLongAlgorithm.set_state: restore into an algorithm that has "
                               "not trained yet (runs are live on its cells)")
        if XLONG in state and "learner_dir" in state[XLONG]:
            if self._restore_path is None:
                raise ValueError("XLongAlgorithm.set_state: a state naming a Learner checkpoint "
                                 "(learner_dir) restores through restore_from_path(path)")
            self._start_dir = str(pathlib.Path(self._restore_path) / state[XLONG]["learner_dir"])
            self._start_state, self._start_loaded = None, False
            self.policy_version = int(state[XLONG]["policy_version"])
            position = state[XLONG].get("data_position")
            self._data_position = int(position) if position is not None else None
            from ray_xlong.models.export import learner_meta

            saved = learner_meta(self._start_dir).get("version")
            if saved is not None and int(saved) != self.policy_version:
                raise ValueError(f"XLongAlgorithm.set_state: the Learner checkpoint "
                                 f"{self._start_dir} holds version {saved}, the state "
                                 f"policy_version {self.policy_version}")
        elif XLONG in state:
            self._start_state = state[XLONG]["learner"]
            self._start_dir, self._start_loaded = None, False
            self.policy_version = int(state[XLONG]["policy_version"])
            position = state[XLONG].get("data_position")
            self._data_position = int(position) if position is not None else None
            if int(self._start_state["version"]) != self.policy_version:
                raise ValueError("XLongAlgorithm.set_state: learner state version "
                                 f"{self._start_state['version']} != policy_version "
                                 f"{self.policy_version}")
        if TRAINING_ITERATION in state:
            self._iteration = int(state[TRAINING_ITERATION])

    def get_checkpointable_components(self) -> list:
        return []

    def restore_from_path(self, path, *args, **kwargs) -> None:
        self._restore_path = str(path)
        try:
            Checkpointable.restore_from_path(self, path, *args, **kwargs)
        finally:
            self._restore_path = None

    @classmethod
    def from_checkpoint(cls, path: str | pathlib.Path, filesystem=None, *,
                        config: XLongConfig | None = None, **kwargs) -> "XLongAlgorithm":
        """A new algorithm built from the checkpoint's config (or ``config``) and restored.

        RLlib's ``Checkpointable.from_checkpoint`` unpickles the saved config; when that fails
        (a class it names, e.g. the user's callbacks, does not import in this process) it
        silently builds the algorithm with no config and dies on ``None.to_dict()``. Here
        that failure is an error naming the cause, and ``config`` builds the algorithm
        instead of the saved config (restoring its state the same way).

        Args:
            path: a directory written by ``save_to_path``.
            filesystem: a pyarrow filesystem (None: inferred from ``path``).
            config: build from this config instead of the saved one.

        Raises:
            ValueError: the saved config cannot be loaded here and no ``config`` was given.
        """
        if config is not None:
            algo = cls(config=config)
            algo.restore_from_path(path, filesystem=filesystem, **kwargs)
            return algo
        ctor_file = pathlib.Path(path) / cls.CLASS_AND_CTOR_ARGS_FILE_NAME
        if filesystem is None and ctor_file.exists():
            try:
                with open(ctor_file, "rb") as f:
                    pickle.load(f)
            except Exception as exc:
                raise ValueError(
                    f"XLongAlgorithm.from_checkpoint: cannot load the saved config from "
                    f"{ctor_file} ({type(exc).__name__}: {exc}); make the classes it names "
                    f"(e.g. callbacks) importable in this process, or pass config=") from exc
        return super().from_checkpoint(str(path), filesystem, **kwargs)

    # -- evaluation ------------------------------------------------------------------------------
    def evaluate(self, parallel_train_future=None) -> dict[str, Any]:
        """One evaluation round on the rollout cells (``rllib/evaluation.py``): K held-out
        instances × k samples, never trained. Returns RLlib's ``evaluation`` block."""
        from ray_xlong.rllib import evaluation as ev

        return ev.evaluate(self, parallel_train_future)

    def cleanup(self) -> None:
        pool = getattr(self, "pool", None)
        if pool is not None:
            pool.shutdown()
            self.pool = None


def _ensure_ray(layout) -> None:
    """Start an embedded local Ray with the layout's (logical) resources if none is up."""
    if ray.is_initialized():
        return
    gpus = layout.cells * layout.nodes_per_cell * layout.gpus_per_node
    cpus = max(os.cpu_count() or 1, layout.cells * layout.nodes_per_cell
               * layout.cpus_per_bundle)
    ray.init(num_cpus=int(-(-cpus // 1)), num_gpus=gpus, include_dashboard=False,
             log_to_driver=False, _system_config=KEEP_TASK_WORKERS)


class XLongConfig(AlgorithmConfig):
    """AlgorithmConfig of :class:`~ray_xlong.rllib.algorithm.XLongAlgorithm` (module doc)."""

    def __init__(self, algo_class: type | None = None) -> None:
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
              normalize_std: bool = NotProvided, sharding: ShardingSettings = NotProvided,
              engine_settings: EngineSettings = NotProvided,
              context_parallel: int = NotProvided, attn_implementation: str | None = NotProvided,
              harness: HarnessConfig = NotProvided,
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
        if self.evaluation_num_env_runners:
            import logging

            logging.getLogger(__name__).warning(
                "XLongConfig.evaluation_num_env_runners=%s is not used: evaluation runs on the "
                "rollout cells (no separate evaluation runners)", self.evaluation_num_env_runners)

    def job_config(self, *, group_offset: int):
        """The cell layer's job record (``ray_xlong.cells.config.XLongConfig``)."""
        from ray_xlong.cells.layout import CellLayout
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
                                  grad_clip=self.grad_clip,
                                  context_parallel=opt.context_parallel,
                                  attn_implementation=opt.attn_implementation)
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
            poll_s=opt.poll_s, spool_dir=opt.spool_dir, sharding=opt.sharding)
