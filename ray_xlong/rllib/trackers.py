"""Experiment trackers through Ray Tune's logger callbacks: W&B, MLflow (and TensorBoard).

Under Tune (the way RLlib users run an algorithm) the trackers are Tune callbacks::

    tune.Tuner(XLongAlgorithm, param_space=config,
               run_config=tune.RunConfig(callbacks=tracker_callbacks(
                   ("wandb", "mlflow"), project="my_project", out_dir="out/trackers")))

and TensorBoard, ``progress.csv`` and ``result.json`` are Tune's defaults, as before.
``ray-xlong train`` drives ``algo.train()`` itself, so :class:`TrackerSession` feeds the same
callbacks the way Tune's controller does (``setup`` → ``log_trial_start`` → one
``log_trial_result`` per step → ``log_trial_end`` → ``on_experiment_end``) for one trial whose
directory is ``out_dir/<project>/<trial id>``; TensorBoard comes from Tune's ``TBXLoggerCallback``
the same way. Turn them on with ``run.trackers: [wandb, mlflow]`` in a config file or
``--tracker wandb --tracker mlflow``.

* W&B: ``wandb.init(mode=...)`` with ``WANDB_MODE`` if set, else ``offline`` unless an API key
  is configured (``WANDB_API_KEY``); offline runs land in ``out_dir/wandb/`` (``wandb sync``).
  The logging actor waits for W&B to write everything before it ends (``wandb.teardown()``).
* MLflow: ``MLFLOW_TRACKING_URI`` if set, else a file store ``out_dir/mlruns`` (MLflow 3 keeps
  file stores behind ``MLFLOW_ALLOW_FILE_STORE=true``, set here; ``mlflow-skinny`` suffices, no
  database); experiment = the project.
"""

from __future__ import annotations

import functools
import os
import pathlib
import uuid
from typing import Any, Sequence

TRACKERS = ("wandb", "mlflow", "tensorboard")
"""Tracker names :func:`tracker_callbacks` knows."""


def cli_trackers(chosen: Sequence[str]) -> tuple[str, ...]:
    """What ``ray-xlong train`` logs to: TensorBoard (when tensorboardX is installed, as under
    Tune) and the ``chosen`` trackers."""
    import importlib.util

    tensorboard = ("tensorboard",) if importlib.util.find_spec("tensorboardX") else ()
    return (*tensorboard, *chosen)


def tracker_callbacks(trackers: Sequence[str], *, project: str,
                      out_dir: str | os.PathLike) -> list[Any]:
    """Tune ``LoggerCallback`` objects for ``trackers``.

    Args:
        trackers: any of :data:`TRACKERS` (``tensorboard`` is only needed outside Tune, where
            Tune's default loggers do not run).
        project: W&B project and MLflow experiment name.
        out_dir: where offline W&B runs and the MLflow file store go.

    Raises:
        ValueError: an unknown tracker, or its package is not installed (named).
    """
    unknown = sorted(set(trackers) - set(TRACKERS))
    if unknown:
        raise ValueError(f"trackers: unknown {unknown}; choose from {TRACKERS}")
    out = pathlib.Path(out_dir).resolve()
    callbacks: list[Any] = []
    for name in dict.fromkeys(trackers):
        _need(name)
        if name == "wandb":
            (out / "wandb").mkdir(parents=True, exist_ok=True)
            mode = wandb_mode()
            os.environ["WANDB_MODE"] = mode        # Ray's callback asks for a key unless set
            callbacks.append(_wandb_callback_class()(project=project, mode=mode,
                                                     dir=str(out), log_config=False))
        elif name == "mlflow":
            from ray.air.integrations.mlflow import MLflowLoggerCallback

            uri = os.environ.get("MLFLOW_TRACKING_URI")
            if not uri:     # a file store: no server, no database (MLflow 3 asks to opt in)
                uri = (out / "mlruns").as_uri()
                os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            callbacks.append(MLflowLoggerCallback(tracking_uri=uri, experiment_name=project,
                                                  save_artifact=False))
        else:
            from ray.tune.logger import TBXLoggerCallback

            callbacks.append(TBXLoggerCallback())
    return callbacks


@functools.cache
def _wandb_callback_class() -> type:
    """Ray's ``WandbLoggerCallback`` whose logging actor returns only once W&B has written
    everything: Ray kills the actor as soon as its ``run()`` returns, and ``wandb.finish()``
    (0.31) returns before the ``wandb-core`` process has written the run's history, so under
    load an offline run kept only its header (measured in CI: history lost, the core's log cut
    off after the finish). ``wandb.teardown()`` waits for the core to finish and exit."""
    from ray.air.integrations.wandb import WandbLoggerCallback, _WandbLoggingActor

    class _FlushedWandbLoggingActor(_WandbLoggingActor):
        def run(self):
            try:
                super().run()
            finally:
                self._wandb.teardown()

    class FlushedWandbLoggerCallback(WandbLoggerCallback):
        _logger_actor_cls = _FlushedWandbLoggingActor

    return FlushedWandbLoggerCallback


def wandb_mode() -> str:
    """``WANDB_MODE`` if set; ``online`` with an API key in the environment; else offline."""
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    return "online" if os.environ.get("WANDB_API_KEY") else "offline"


def _need(name: str) -> None:
    import importlib.util

    module = {"wandb": "wandb", "mlflow": "mlflow", "tensorboard": "tensorboardX"}[name]
    if importlib.util.find_spec(module) is None:
        raise ValueError(f"trackers: {name} needs the {module} package (pip install "
                         f"'ray-xlong[test]' or pip install {module})")


class TrackerSession:
    """One trial's worth of Tune logger callbacks, driven outside Tune (module docstring)."""

    def __init__(self, callbacks: Sequence[Any], *, project: str, out_dir: str | os.PathLike,
                 config: dict[str, Any]) -> None:
        """Args:
            callbacks: from :func:`tracker_callbacks`.
            project: names the experiment directory.
            out_dir: the experiment directory's parent.
            config: the run's configuration (plain values), logged as parameters.
        """
        from ray.train._internal.storage import StorageContext
        from ray.tune.experiment import Trial

        self.callbacks = list(callbacks)
        trial_id = uuid.uuid4().hex[:8]
        storage = StorageContext(storage_path=str(pathlib.Path(out_dir).resolve()),
                                 experiment_dir_name=project,
                                 trial_dir_name=f"XLongAlgorithm_{trial_id}")
        self.trial = Trial("XLongAlgorithm", config=_flat(config), trial_id=trial_id,
                           storage=storage, stub=True)
        self.trial.init_local_path()     # W&B's logging actor starts in it
        self.iteration = 0
        for cb in self.callbacks:
            cb.setup()
            cb.log_trial_start(self.trial)

    def log(self, result: dict[str, Any]) -> None:
        """Log one ``algo.train()`` result (the ``config`` block is left out)."""
        self.iteration += 1
        clean = {k: v for k, v in result.items() if k != "config"}
        for cb in self.callbacks:
            cb.log_trial_result(self.iteration, self.trial, clean)

    def close(self, *, failed: bool = False) -> None:
        """End the trial (flush, finish the W&B run, close the MLflow run) and copy the trial
        directory (TensorBoard events) from Ray's staging folder to ``out_dir`` as Tune does."""
        import shutil

        for cb in self.callbacks:
            cb.log_trial_end(self.trial, failed=failed)
            cb.on_experiment_end(trials=[self.trial])
        self.callbacks.clear()     # their __del__ needs Ray: let it run now, not at exit
        if pathlib.Path(self.trial.local_path).is_dir():
            shutil.copytree(self.trial.local_path, self.trial.path, dirs_exist_ok=True)


def _flat(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"xlong": {"loss": {"kind": …}}}`` → ``{"xlong/loss/kind": …}`` (MLflow params)."""
    out: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}/"))
        else:
            out[f"{prefix}{key}"] = value if not isinstance(value, list) else str(value)
    return out
