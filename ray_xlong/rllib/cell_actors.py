"""What an RLlib cell hosts: ``CellRunner`` (the :class:`AgentEnvRunner` plus the role calls a
switch makes and the run spool) and the ``XLongLearner``, handed to the cell runtime as one
:class:`~ray_xlong.cells.pool.CellActors`::

    actors = cell_actors(rollout=RolloutConfig(...), learner=LearnerSettings(...), seed=0)
    pool = create_cells(layout, actors=actors)       # ray_xlong.cells: no RLlib import there
"""

from __future__ import annotations

import time
from typing import Any, Mapping

import ray

from ray_xlong.cells.config import LearnerSettings
from ray_xlong.cells.pool import CellActors
from ray_xlong.cells.spool import RunSpool
from ray_xlong.rllib.env_runner import AgentEnvRunner, RolloutConfig
from ray_xlong.rllib.learner import XLongLearner, learner_config
from ray_xlong.rollout.tasks import TASKS, TaskFactory, register_task


class CellRunner(AgentEnvRunner):
    """The cell's rollout side: :class:`AgentEnvRunner` plus the calls a role switch makes.

    ``wait_ended`` runs in its own concurrency group so that it can block without delaying
    ordered role calls (``suspend`` / ``resume`` / ``start_runs`` keep submission order).
    """

    def __init__(self, *, config: Any, rollout_config: RolloutConfig,
                 tasks: Mapping[str, TaskFactory], cell: int = -1,
                 spool_dir: str | None = None) -> None:
        for name, factory in tasks.items():
            if name not in TASKS:
                register_task(name, factory)
        self.cell = cell
        self.spool = RunSpool(spool_dir) if spool_dir else None
        super().__init__(config=config, rollout_config=rollout_config)

    def _on_end(self, run_id: str, env, task) -> None:
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

    @ray.method(concurrency_group="poll")
    def wait_ended(self, timeout_s: float) -> list:
        """The :class:`RunResult` of runs ended since the last call; waits up to
        ``timeout_s`` for at least one."""
        deadline = time.monotonic() + timeout_s
        while not self._ended and time.monotonic() < deadline:
            time.sleep(0.002)
        error = getattr(self, "_spool_error", None)
        if error is not None:
            raise RuntimeError(f"cell {self.cell}: spooling an ended run failed: {error!r}")
        return self.sample_results()

    # Role calls take trailing ``after`` refs (ignored): the driver chains each call on the
    # previous one, since Ray does not order the calls of an actor with concurrency groups.
    def start_runs(self, specs, *after: Any) -> list[str]:
        """:meth:`AgentEnvRunner.start_runs` (``after``: refs to wait for)."""
        return super().start_runs(specs)

    def drain(self, *after: Any) -> None:
        """:meth:`AgentEnvRunner.drain` (``after``: refs to wait for)."""
        super().drain()

    def suspend(self, *after: Any) -> float:
        """Rollout → training: drain and sleep the engine (raises with live runs). Returns
        the seconds it took."""
        t = time.perf_counter()
        self.drain()
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


def cell_actors(*, rollout: RolloutConfig, learner: LearnerSettings,
                tasks: Mapping[str, TaskFactory] | None = None, seed: int = 0,
                spool_dir: str | None = None, sharding: Any = None) -> CellActors:
    """The runner (:class:`CellRunner` on ``rollout``; ``tasks`` registered in it; ended runs
    spooled to ``spool_dir`` when given) and the learner (:class:`XLongLearner` on
    ``learner``, seeded) every cell hosts."""
    from ray.rllib.algorithms.algorithm_config import AlgorithmConfig

    config, spec = learner_config(learner, seed=seed)
    return CellActors(
        runner_class=CellRunner,
        runner_kwargs={"config": AlgorithmConfig(), "rollout_config": rollout,
                       "tasks": dict(tasks or {}), "spool_dir": spool_dir},
        learner_class=XLongLearner,
        learner_kwargs={"config": config, "module_spec": spec},
        learner_settings=learner, sharding=sharding)
