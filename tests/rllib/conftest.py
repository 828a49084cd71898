"""The expensive set-up the RLlib tests share, built once per test run.

``trained_algo``: one ``XLongAlgorithm`` (2 cells, 2 groups × 4 runs per step, a plain tiny
model, the user's own task by factory, evaluation every second iteration) trained 3 steps; its
checkpoint, Hugging Face export, weights and callbacks as they were after step 2; the RLlib
deprecation warnings
logged while it ran. ``test_algorithm.py`` (steps 1-2, the checkpoint) and ``test_results.py``
(steps 1-3: RLlib's result check, documented keys, lifetime counters) read it; building cells and
training cost ~30-60 s, paid once.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import tempfile
from typing import Any

import pytest


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
    """The actuator's ``EvalRuns`` after step 3 (placements, outcomes of the evaluation)."""
    trained_runs: dict[int, list[str]] | None = None
    """Scheduler step → run ids it trained (``RayActuator.trained``) after step 3."""
    spooled: list[str] | None = None
    """Run ids in the run spool after step 3 (none of them an evaluation run)."""
    exported: Any = None
    """``export_hf`` after step 2 (a Hugging Face directory)."""
    model_dir: str = ""
    """The policy directory it was built from."""


@pytest.fixture(scope="session")
def trained_algo(tmp_path_factory) -> TrainedAlgo:
    ray = pytest.importorskip("ray")
    from algo_helpers import RecordingCallbacks, small_config, user_task

    from ray_xlong.models import build_tiny_model_dir

    model_dir = str(build_tiny_model_dir(tmp_path_factory.mktemp("algo") / "policy", seed=0))
    if ray.is_initialized():      # its own Ray: 2 logical GPUs, shut down when it is built
        ray.shutdown()
    os.environ["RAY_TMPDIR"] = tempfile.mkdtemp(prefix="rx", dir="/tmp")
    ray.init(num_cpus=2, num_gpus=2, include_dashboard=False, log_to_driver=False)
    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    handler = Keep(level=logging.WARNING)
    logging.getLogger("ray._common.deprecation").addHandler(handler)
    RecordingCallbacks.seen.clear()
    try:
        algo = (small_config(model_dir).xlong(task=user_task(), eval_samples=2,
                                              spool_dir=str(tmp_path_factory.mktemp("spool")))
                .evaluation(evaluation_interval=2, evaluation_duration=2).build_algo())
        assert algo.job.work.task.endswith("user_task.<locals>.Echo")
        results = [algo.train() for _ in range(2)]
        callbacks = list(RecordingCallbacks.seen)
        path = tmp_path_factory.mktemp("ckpt") / "algo"
        algo.save_to_path(str(path))
        exported = algo.export_hf(str(tmp_path_factory.mktemp("export") / "hf"))
        weights = {k: v.clone() for k, v in
                   ray.get(algo.actuator.learners.state_ref)["weights"].items()}
        results.append(algo.train())
        act = algo.actuator.actuator
        eval_runs, trained_runs = act.evals, {k: list(v) for k, v in act.trained.items()}
        spooled = sorted(act.state.spool.run_ids()) if act.state.spool is not None else []
        algo.stop()
    finally:
        logging.getLogger("ray._common.deprecation").removeHandler(handler)
        ray.shutdown()
    return TrainedAlgo(results, path, weights, callbacks, seen, eval_runs=eval_runs,
                       trained_runs=trained_runs, spooled=spooled, exported=exported,
                       model_dir=model_dir)
