"""The expensive set-up the RLlib tests share, built once per test run.

``trained_algo``: one ``XLongAlgorithm`` (2 cells on 2 logical GPUs each, 2 groups × 4 runs per
step, a plain tiny model, the user's own task by factory, engine settings of its own, evaluation
every second iteration) trained 3 steps; the GPU ids its Learners and runners held; its
checkpoint, Hugging Face export, weights and callbacks as they were after step 2; the RLlib
deprecation warnings
logged while it ran. ``test_algorithm.py`` (steps 1-2, the checkpoint), ``test_results.py``
(steps 1-3: RLlib's result check, documented keys, lifetime counters), ``test_export.py`` and
``test_evaluation_cells.py`` and ``test_learner_gpus.py`` read it; building cells and training
cost ~30-60 s, paid once per test run (the pytest-xdist workers share it: ``trained_algo``).
It is built in a running Ray of its size (``test_algorithm.py``'s module Ray, which its other
algorithms share), else in a Ray of its own.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pathlib
import pickle
import tempfile
import types
from typing import Any

import pytest

from tests.shared import run_lock, shared_dir


@dataclasses.dataclass(frozen=True)
class TrainedAlgo:
    """What the shared algorithm produced."""

    results: list[dict[str, Any]]
    """``algo.train()`` of steps 1, 2 and 3."""
    checkpoint: Any
    """``save_to_path`` after step 2."""
    weights: dict[str, Any]
    """The Learner's weights after step 2."""
    callbacks_seen: list[tuple[str, Any]]
    """``RecordingCallbacks.seen`` after step 2."""
    deprecations: list[str]
    """Warnings of ``ray._common.deprecation`` logged while it was built and trained."""
    eval_runs: Any = None
    """The actuator's ``EvalRuns`` after step 3: its ``placements`` and ``ended`` outcomes (a
    copy of those two lists: the object itself holds a lock and actor handles)."""
    trained_runs: dict[int, list[str]] | None = None
    """Scheduler step → run ids it trained (``RayActuator.trained``) after step 3."""
    spooled: list[str] | None = None
    """Run ids in the run spool after step 3 (none of them an evaluation run)."""
    exported: Any = None
    """``export_hf`` after step 2 (a Hugging Face directory)."""
    model_dir: str = ""
    """The policy directory it was built from."""
    learner_gpus: list[list[str]] | None = None
    """Per cell, the Ray GPU ids its Learner held (``ray.get_gpu_ids()`` inside it)."""
    runner_gpus: list[list[str]] | None = None
    """Per cell, the Ray GPU ids its runner held."""
    engine_settings: list[Any] | None = None
    """Per cell, the runner's ``rollout_config.engine_settings``."""


@pytest.fixture(scope="session")
def trained_algo(tmp_path_factory) -> TrainedAlgo:
    """Built once per test run: the first worker to need it builds it under a lock and pickles
    it beside its files; another worker (pytest-xdist) waits for the lock and reads it."""
    root = shared_dir(tmp_path_factory, "trained_algo")
    done = root / "trained_algo.pkl"
    with run_lock(root / ".lock"):
        if done.exists():
            return pickle.loads(done.read_bytes())
        built = _train(root)
        from ray import cloudpickle     # the user's task class is a local one: by value

        done.write_bytes(cloudpickle.dumps(built))
        return built


def _train(root: pathlib.Path) -> TrainedAlgo:
    """Build, train, save and export the shared algorithm under ``root``."""
    ray = pytest.importorskip("ray")
    from algo_helpers import (ENGINE_SETTINGS_KW, SHARED_RAY, RecordingCallbacks,
                              has_shared_resources, small_config, user_task)

    from ray_xlong.models import build_tiny_model_dir
    from ray_xlong.rollout.engine_settings import EngineSettings

    ENGINE_SETTINGS = EngineSettings(**ENGINE_SETTINGS_KW)
    model_dir = str(build_tiny_model_dir(root / "policy", seed=0))
    own = not has_shared_resources(ray)     # a running Ray of the same size (test_algorithm's
    if own:                                 # module Ray) serves; else its own, shut down when
        if ray.is_initialized():            # the algorithm is built
            ray.shutdown()
        os.environ["RAY_TMPDIR"] = tempfile.mkdtemp(prefix="rx", dir="/tmp")
        ray.init(**SHARED_RAY)
    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    handler = Keep(level=logging.WARNING)
    logging.getLogger("ray._common.deprecation").addHandler(handler)
    RecordingCallbacks.seen.clear()
    try:
        algo = (small_config(model_dir).xlong(task=user_task(), eval_samples=2,
                                              spool_dir=str(root / "spool"), gpus_per_node=2,
                                              engine_settings=ENGINE_SETTINGS)
                .evaluation(evaluation_interval=2, evaluation_duration=2).build_algo())
        assert algo.job.work.task.endswith("user_task.<locals>.Echo")
        cells = algo.pool.cells
        learner_gpus = [held_gpus(c.learner) for c in cells]
        runner_gpus = [held_gpus(c.runner) for c in cells]
        engine_settings = ray.get([c.runner.__ray_call__.remote(
            lambda self: self.rollout_config.engine_settings) for c in cells])
        results = [algo.train() for _ in range(2)]
        callbacks = list(RecordingCallbacks.seen)
        path = root / "ckpt" / "algo"
        algo.save_to_path(str(path))
        exported = algo.export_hf(str(root / "export" / "hf"))
        weights = {k: v.clone() for k, v in
                   ray.get(algo.actuator.learners.state_ref)["weights"].items()}
        results.append(algo.train())
        act = algo.actuator.actuator
        eval_runs = types.SimpleNamespace(placements=list(act.evals.placements),
                                          ended=list(act.evals.ended))
        trained_runs = {k: list(v) for k, v in act.trained.items()}
        spooled = sorted(act.state.spool.run_ids()) if act.state.spool is not None else []
        algo.stop()
    finally:
        logging.getLogger("ray._common.deprecation").removeHandler(handler)
        if own:
            ray.shutdown()
    return TrainedAlgo(results, path, weights, callbacks, seen, eval_runs=eval_runs,
                       trained_runs=trained_runs, spooled=spooled, exported=exported,
                       model_dir=model_dir, learner_gpus=learner_gpus, runner_gpus=runner_gpus,
                       engine_settings=engine_settings)


def held_gpus(actor) -> list[str]:
    """Ray GPU ids ``actor`` holds (asked inside it)."""
    import ray

    return [str(i) for i in ray.get(actor.__ray_call__.remote(lambda self: ray.get_gpu_ids()))]
