"""Experiment trackers through Ray Tune's logger callbacks, read back from what they wrote:
W&B in offline mode (the run's ``.wandb`` record log), MLflow in a file store (its client), and
TensorBoard (the event file) — driven the way ``ray-xlong train`` does (``TrackerSession``).
Under ``tune.Tuner`` with a real ``XLongAlgorithm`` (the documented Python way):
``test_algorithm_tune.py``, whose one trial also carries the trackers' callbacks."""

from __future__ import annotations

import tempfile

import pytest

pytestmark = [pytest.mark.ray]
ray = pytest.importorskip("ray")
pytest.importorskip("wandb")
pytest.importorskip("mlflow")

from ray_xlong.rllib.trackers import TrackerSession, tracker_callbacks  # noqa: E402
from tracker_readers import mlflow_history, tensorboard_scalars, wandb_history  # noqa: E402

LOSS = "learners/default_policy/policy_loss"
REWARD = "env_runners/episode_return_mean"


@pytest.fixture
def local_ray(monkeypatch):
    """A one-CPU Ray (the root conftest's autouse fixture has cleared the trackers' settings)."""
    if ray.is_initialized():
        ray.shutdown()
    monkeypatch.setenv("RAY_TMPDIR", tempfile.mkdtemp(prefix="rx", dir="/tmp"))
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def test_session_logs_every_step_to_wandb_mlflow_and_tensorboard(local_ray, tmp_path):
    results = [{"training_iteration": i, "learners": {"default_policy": {"policy_loss": 0.5 * i}},
                "env_runners": {"episode_return_mean": 0.25 + i}, "config": {"lr": 1.0}}
               for i in (1, 2, 3)]
    callbacks = tracker_callbacks(("wandb", "mlflow", "tensorboard"), project="xl",
                                  out_dir=tmp_path)
    session = TrackerSession(callbacks, project="xl", out_dir=tmp_path,
                             config={"xlong": {"mode": "elastic"}, "run": {"steps": 3}})
    for r in results:
        session.log(r)
    session.close()

    rows = wandb_history(tmp_path)
    assert [(r["training_iteration"], r[LOSS], r[REWARD]) for r in rows] == [
        (1, 0.5, 1.25), (2, 1.0, 2.25), (3, 1.5, 3.25)]
    assert mlflow_history(tmp_path, "xl", LOSS) == [(1, 0.5), (2, 1.0), (3, 1.5)]
    assert mlflow_history(tmp_path, "xl", REWARD) == [(1, 1.25), (2, 2.25), (3, 3.25)]
    (events,) = tmp_path.glob("xl/XLongAlgorithm_*/events.out.tfevents.*")
    scalars = tensorboard_scalars(events)
    assert scalars[f"ray/tune/{LOSS}"] == [(1, 0.5), (2, 1.0), (3, 1.5)]


def test_unknown_tracker_is_an_error_naming_it(tmp_path):
    with pytest.raises(ValueError, match="unknown \\['comet'\\]"):
        tracker_callbacks(("wandb", "comet"), project="p", out_dir=tmp_path)
