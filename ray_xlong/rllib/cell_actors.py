"""What an RLlib cell hosts: ``CellRunner`` (the :class:`AgentEnvRunner` plus the role calls a
switch makes, the run spool, and each run processed where it ended) and the ``XLongLearner``,
handed to the cell runtime as one :class:`~ray_xlong.cells.pool.CellActors`::

    run ends ─► spool ─► process_run (assemble → cap K → tree → count-once) ─► wait_ended:
                 (digests ─► driver, a few numbers per run;  episodes ─► object store ─► the
                  Learner connector pipeline of the cell that trains them)


    actors = cell_actors(rollout=RolloutConfig(...), learner=LearnerSettings(...), seed=0)
    pool = create_cells(layout, actors=actors)       # ray_xlong.cells: no RLlib import there
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Any, Callable, Mapping

import ray

from ray_xlong.cells.config import LearnerSettings
from ray_xlong.cells.cell_engines import CellEngines
from ray_xlong.cells.eval_runs import EvalOutcome, EvalReport
from ray_xlong.cells.pool import CellActors
from ray_xlong.cells.spool import RunSpool
from ray_xlong.rllib.env_runner import AgentEnvRunner, RolloutConfig
from ray_xlong.rllib.episodes import run_to_episode
from ray_xlong.rllib.learner import ConnectorBatches, XLongLearner, learner_config
from ray_xlong.rollout.run_stats import run_stats
from ray_xlong.rollout.tasks import TASKS, TaskFactory, register_task
from ray_xlong.serving.agents import register_agent_task
from ray_xlong.trajectory import ProcessorConfig
from ray_xlong.trajectory.per_run import RunDigest, process_run


class CellRunner(AgentEnvRunner):
    """The cell's rollout side: :class:`AgentEnvRunner` plus the calls a role switch makes.

    ``wait_ended`` runs in its own concurrency group so that it can block without delaying
    ordered role calls (``suspend`` / ``resume`` / ``start_runs`` keep submission order).
    """

    def __init__(self, *, config: Any, rollout_config: RolloutConfig,
                 tasks: Mapping[str, TaskFactory], cell: int = -1,
                 spool_dir: str | None = None,
                 processor: ProcessorConfig = ProcessorConfig(),
                 agent_tasks: Mapping[str, Callable[[int], Any]] | None = None) -> None:
        for name, factory in tasks.items():
            if name not in TASKS:
                register_task(name, factory)
        for name, make in (agent_tasks or {}).items():     # external agents (serving.agents)
            register_agent_task(name, make)
        self.cell = cell
        self.processor = processor
        self.spool = RunSpool(spool_dir) if spool_dir else None
        self._eval_ids: dict[str, str] = {}      # live evaluation run → its group
        self._eval_ended: list[EvalOutcome] = []
        self._eval_preempted: list[str] = []
        super().__init__(config=config, rollout_config=rollout_config)

    def _on_end(self, run_id: str, env, task) -> None:
        if run_id in self._eval_ids:      # evaluation: reported apart, never spooled/trained
            self._eval_end(run_id, env, task)
            return
        # Spool first, then hand over: a runner that dies in between loses nothing. A spool
        # that fails (disk full) still hands the run over, and the error reaches the driver
        # through wait_ended (never a run that silently never ends).
        try:
            if self.spool is not None and not task.cancelled() and task.exception() is None:
                self.spool.put(self.cell, task.result())
        except Exception as exc:  # noqa: BLE001 - reported by wait_ended
            self._spool_error = exc
        finally:
            super()._on_end(run_id, env, task)

    # -- evaluation runs (cells/eval_runs.py) ------------------------------------------------
    def start_eval_runs(self, specs, *after: Any) -> int:
        """Start held-out evaluation runs beside the training runs: they end in
        :meth:`take_eval`, never in :meth:`wait_ended` nor the spool. On a runner that takes
        no runs (draining, asleep) they are reported preempted at once. Returns how many
        started."""
        if self._draining or self._stopped or getattr(self.engine, "is_sleeping", False):
            async def refuse() -> None:
                self._eval_preempted.extend(s.run_id for s in specs)
                self._news.set()

            self._call(refuse())
            return 0
        self._eval_ids.update({s.run_id: s.group_id for s in specs})
        try:
            super().start_runs(specs)
        except Exception:
            for s in specs:
                self._eval_ids.pop(s.run_id, None)
            raise
        return len(specs)

    def _eval_end(self, run_id: str, env, task) -> None:
        try:
            self._eval_outcome(run_id, env, task)
        finally:
            self._news.set()

    def _eval_outcome(self, run_id: str, env, task) -> None:
        group = self._eval_ids.pop(run_id, "")
        self._live.pop(run_id, None)
        if env is not None:
            env.close()
        if task.cancelled():
            self._eval_preempted.append(run_id)
            return
        if task.exception() is not None:
            self._eval_ended.append(EvalOutcome(run_id, group, 0.0, self.cell,
                                                self.policy_version, failed=True))
            return
        run = task.result().run
        versions = [c.policy_version for c in run.calls]
        self._eval_ended.append(EvalOutcome(run_id, run.group_id, float(run.reward), self.cell,
                                            min(versions, default=self.policy_version)))

    def take_eval(self) -> EvalReport:
        """Evaluation runs that ended, and those cancelled, since the last call."""
        async def take() -> EvalReport:
            out = EvalReport(tuple(self._eval_ended), tuple(self._eval_preempted))
            self._eval_ended, self._eval_preempted = [], []
            return out

        return self._call(take())

    async def _preempt_eval(self) -> int:
        tasks = [t for r, t in self._live.items() if r in self._eval_ids]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.sleep(0)       # the runs' done callbacks have run
        return len(tasks)

    @ray.method(concurrency_group="poll", num_returns=2)
    def wait_ended(self, timeout_s: float) -> tuple[list[RunDigest], list]:
        """Runs ended since the last call (waits up to ``timeout_s`` for at least one),
        processed here, where they ended. Two returns: their :class:`RunDigest` (what the
        driver reads) and their episodes with the ``ProcessedRun`` (what a Learner reads; the
        driver passes the ref on without fetching it)."""
        self._wait_until(lambda: bool(self._ended or self._eval_ended or self._eval_preempted),
                         timeout_s)
        error = getattr(self, "_spool_error", None)
        if error is not None:
            raise RuntimeError(f"cell {self.cell}: spooling an ended run failed: {error!r}")
        return self._processed(self.sample_results())

    @ray.method(num_returns=2)
    def process_spooled(self, run_ids: list[str]) -> tuple[list[RunDigest], list]:
        """Like :meth:`wait_ended` for runs read from the spool (recovery: runs whose runner or
        payload was lost). Raises when there is no spool or a run is not in it."""
        if self.spool is None:
            raise RuntimeError(f"cell {self.cell}: no spool to read runs {run_ids} from")
        got = self.spool.get(run_ids)
        missing = sorted(set(run_ids) - set(got))
        if missing:
            raise KeyError(f"cell {self.cell}: runs {missing} are not in the spool")
        return self._processed([res for _, res in got.values()])

    def _processed(self, results: list) -> tuple[list[RunDigest], list]:
        done = [process_run(res.run, self.processor) for res in results]
        episodes = [run_to_episode(res.run, processed=p) for res, p in zip(results, done)]
        return [dataclasses.replace(p.digest, agent=run_stats(res))
                for res, p in zip(results, done)], episodes

    # Role calls take trailing ``after`` refs (ignored): the driver chains each call on the
    # previous one, since Ray does not order the calls of an actor with concurrency groups.
    def start_runs(self, specs, *after: Any) -> list[str]:
        """:meth:`AgentEnvRunner.start_runs` (``after``: refs to wait for)."""
        return super().start_runs(specs)

    def drain(self, *after: Any) -> None:
        """:meth:`AgentEnvRunner.drain` (``after``: refs to wait for)."""
        super().drain()

    def suspend(self, *after: Any) -> float:
        """Rollout → training: drain, cancel the live evaluation runs (reported preempted:
        evaluation never delays a switch) and sleep the engine (raises with live training
        runs). Returns the seconds it took."""
        t = time.perf_counter()
        self.drain()
        self._call(self._preempt_eval())
        self.sleep()
        return time.perf_counter() - t

    def resume(self, weights: Mapping[str, Any] | None, version: int, *after: Any) -> float:
        """Training → rollout: load ``weights`` of ``version`` (if given), wake, take runs
        again. ``after`` is ignored: pass refs (the learner's sleep, this runner's own pending
        ``suspend``) to make Ray run this once they resolved — calls of an actor with
        concurrency groups are not guaranteed to run in submission order. Returns the seconds
        it took."""
        t = time.perf_counter()
        if weights is not None:
            self.set_weights(weights, version)
        self.wake_up()
        self.undrain()
        return time.perf_counter() - t

    def receive_weights(self, spec: Any, version: int) -> float:
        """The weights of ``version`` from the sender of ``spec``'s sync group, bucket by
        bucket (``cells/broadcast.py``), loaded as :meth:`set_weights` loads them: between
        engine batches, into every engine of the cell (engine actors: the first receives, the
        others load its copy). Returns the seconds it took."""
        t = time.perf_counter()
        self._call(self.engine.receive_weights(spec, version))
        return time.perf_counter() - t

    def engine_routing(self) -> Any:
        """Runs per engine, and with engine actors their handles and GPUs
        (``cells.engines.EngineRouting``)."""
        return self.engine.report()

    def engine_weights(self) -> list[dict[str, Any]]:
        """Each engine's model weights (``{}`` for an engine without a torch model), to check
        what a sync delivered."""
        return self.engine.engine_weights()


def cell_actors(*, rollout: RolloutConfig, learner: LearnerSettings,
                processor: ProcessorConfig = ProcessorConfig(),
                tasks: Mapping[str, TaskFactory] | None = None, seed: int = 0,
                spool_dir: str | None = None,
                learner_connector: Callable[..., Any] | None = None,
                sharding: Any = None,
                agent_tasks: Mapping[str, Callable[[int], Any]] | None = None) -> CellActors:
    """The runner (:class:`CellRunner` on ``rollout``: processes each run where it ended with
    ``processor``; ``tasks`` registered in it, and ``agent_tasks`` (external agents:
    ``make(seed) -> AgentTask``, run through the cell's endpoint); ended runs spooled to
    ``spool_dir`` when given) and the learner (:class:`XLongLearner` on ``learner``, seeded;
    its Learner connector pipeline runs the user's ``learner_connector`` pieces, then
    ``PrefixTreeConnector``). With
    ``sharding`` of more than one rank (or on CUDA) a cell's learner is a set of ranks instead,
    running the same pipeline (:class:`ConnectorBatches`). A ``rollout.engine_factory`` that is
    a ``CellEngines`` gets its ``EngineLayout.placement`` decided here when None (engine
    actors on ``sharding.device='cuda'``), and with engine actors the runner holds no GPU."""
    from ray.rllib.algorithms.algorithm_config import AlgorithmConfig

    config, spec = learner_config(learner, seed=seed, processor=processor,
                                  learner_connector=learner_connector)
    engines = rollout.engine_factory
    if isinstance(engines, CellEngines):       # placement None: decided by the cell's device
        engines = engines.resolve(sharding.device if sharding is not None else "cpu")
        rollout = dataclasses.replace(rollout, engine_factory=engines)
    return CellActors(
        runner_class=CellRunner,
        runner_kwargs={"config": AlgorithmConfig(), "rollout_config": rollout,
                       "tasks": dict(tasks or {}), "spool_dir": spool_dir,
                       "processor": processor, "agent_tasks": dict(agent_tasks or {})},
        learner_class=XLongLearner,
        learner_kwargs={"config": config, "module_spec": spec},
        learner_settings=learner, sharding=sharding, batch_of=ConnectorBatches(config),
        engines=engines.layout if isinstance(engines, CellEngines) else None)
