"""XLongAlgorithm's results reach Ray's loggers the way RLlib users expect: under
``tune.Tuner`` the ``xlong/*`` metrics land in the trial's ``result.json``, ``progress.csv``
and TensorBoard event file (tensorboardX), next to RLlib's own ``env_runners/*`` keys; and the
experiment trackers' Tune callbacks (W&B offline, MLflow in a file store) log what the trial's
``result.json`` holds, RLlib's evaluation block included. One trial serves every Tune test here.

The trackers driven outside Tune, the way ``ray-xlong train`` does (``TrackerSession``: W&B
offline, MLflow in a file store, TensorBoard, read back from what they wrote), run in the same
module Ray (moved from ``test_trackers.py``: one ``ray.init`` fewer, ~12 s of CPU)."""

from __future__ import annotations

import csv
import dataclasses
import json
import os
import pathlib
import tempfile

import pytest

pytestmark = [pytest.mark.ray, pytest.mark.rllib]
ray = pytest.importorskip("ray")
tune = pytest.importorskip("ray.tune")
pytest.importorskip("wandb")
pytest.importorskip("mlflow")

from ray_xlong.rllib.algorithm import STEP_METRICS, XLONG, XLongAlgorithm  # noqa: E402
from ray_xlong.rllib.algorithm_config import XLongConfig  # noqa: E402
from ray_xlong.rllib.trackers import TrackerSession, tracker_callbacks  # noqa: E402
from tests.shared import clean_tracker_env  # noqa: E402
from tracker_readers import mlflow_history, tensorboard_scalars, wandb_history  # noqa: E402

ROLES = ("rollout", "draining", "training", "syncing")
XLONG_KEYS = set(STEP_METRICS) | {f"cells_{r}" for r in ROLES}


@dataclasses.dataclass(frozen=True)
class Trial:
    """The shared trial's directory and the trackers' output folder."""

    path: pathlib.Path
    trackers: pathlib.Path


@pytest.fixture(scope="module")
def module_ray():
    """The module's Ray: the trial's driver bundle (1 CPU) + two cells (1 CPU, 1 logical GPU
    each); started without the trackers' environment (its workers inherit the driver's)."""
    if ray.is_initialized():
        ray.shutdown()
    with pytest.MonkeyPatch.context() as env:
        env.setenv("RAY_TMPDIR", tempfile.mkdtemp(prefix="rx", dir="/tmp"))  # short sockets
        with clean_tracker_env():
            ray.init(num_cpus=3, num_gpus=2, include_dashboard=False, log_to_driver=False)
        try:
            yield
        finally:
            ray.shutdown()


@pytest.fixture(scope="module")
def trial(module_ray, tmp_path_factory):
    """Two training iterations of a 2-cell elastic job under ``tune.Tuner`` with the W&B and
    MLflow callbacks, evaluating at iteration 2 on the rollout cells beside the step (RLlib's
    parallel mode)."""
    from ray_xlong.models import build_tiny_model_dir

    tmp = tmp_path_factory.mktemp("tune")
    out = tmp / "trackers"
    with clean_tracker_env():
        model_dir = str(build_tiny_model_dir(tmp / "policy", seed=0))
        config = (XLongConfig().lookup_recipe().training(train_batch_size_per_learner=4)
                  .debugging(seed=0)
                  .xlong(mode="elastic", cells=2, runs_per_group=2, slots_per_cell=4,
                         model_dir=model_dir, placement_strategy="PACK", eval_samples=2)
                  .evaluation(evaluation_interval=2, evaluation_duration=1,
                              evaluation_num_env_runners=1,
                              evaluation_parallel_to_training=True,
                              evaluation_config={"num_cpus_per_env_runner": 0}))
        grid = tune.Tuner(XLongAlgorithm, param_space=config, run_config=tune.RunConfig(
            name="xlong", storage_path=str(tmp / "results"),
            stop={"training_iteration": 2}, verbose=0,
            callbacks=tracker_callbacks(("wandb", "mlflow"), project="xl",
                                        out_dir=out))).fit()
        assert os.environ.get("WANDB_MODE") == "offline"
    result = grid[0]
    assert result.error is None, result.error
    assert set(result.metrics[XLONG]) == XLONG_KEYS
    assert result.metrics[XLONG]["policy_version"] == 2
    return Trial(pathlib.Path(result.path), out)


@pytest.fixture(scope="module")
def trial_dir(trial):
    return trial.path


@pytest.mark.slow
def test_result_json_holds_the_nested_xlong_metrics(trial_dir):
    lines = [json.loads(line) for line in (trial_dir / "result.json").read_text().splitlines()]
    assert [r["training_iteration"] for r in lines] == [1, 2]
    for step, r in enumerate(lines, start=1):
        assert set(r[XLONG]) == XLONG_KEYS and r[XLONG]["policy_version"] == step
        assert r[XLONG]["runs"] == 4 and r["env_runners"]["num_episodes"] == 4
        assert r[XLONG]["unique_tokens"] <= r[XLONG]["total_tokens"]
        assert sum(r[XLONG][f"cells_{role}"] for role in ROLES) == 2


@pytest.mark.slow
def test_progress_csv_has_a_column_per_metric(trial_dir):
    with open(trial_dir / "progress.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 2
    assert {f"{XLONG}/{k}" for k in XLONG_KEYS} | {"env_runners/episode_return_mean"} \
        <= set(rows[0])


@pytest.mark.slow
def test_tensorboard_scalars_per_iteration(trial_dir):
    (events,) = trial_dir.glob("events.out.tfevents*")
    scalars = tensorboard_scalars(events)
    for key in XLONG_KEYS:
        assert [step for step, _ in scalars[f"ray/tune/{XLONG}/{key}"]] == [1, 2], key
    assert [v for _, v in scalars[f"ray/tune/{XLONG}/policy_version"]] == [1.0, 2.0]
    assert "ray/tune/env_runners/episode_return_mean" in scalars


@pytest.mark.slow
def test_trackers_log_the_algorithms_metrics(trial):
    """What the W&B and MLflow callbacks wrote equals the trial's result.json, the evaluation
    block of iteration 2 included."""
    lines = [json.loads(x) for x in (trial.path / "result.json").read_text().splitlines()]
    key = "learners/default_policy/entropy"          # > 0 on any trained token
    want = [r["learners"]["default_policy"]["entropy"] for r in lines]
    assert len(want) == 2 and min(want) > 0
    rows = wandb_history(trial.trackers)
    assert [r["training_iteration"] for r in rows] == [1, 2]
    assert [r[key] for r in rows] == pytest.approx(want)
    history = mlflow_history(trial.trackers, "xl", key)
    assert [step for step, _ in history] == [1, 2]
    assert [value for _, value in history] == pytest.approx(want)
    # RLlib's evaluation block (iteration 2 only) reaches both trackers under its own keys
    ev_key = "evaluation/env_runners/pass_at_2"
    ev_want = [r["evaluation"]["env_runners"]["pass_at_2"] for r in lines if "evaluation" in r]
    assert len(ev_want) == 1
    assert [r[ev_key] for r in rows if r.get(ev_key) is not None] == pytest.approx(ev_want)
    assert mlflow_history(trial.trackers, "xl", ev_key) == [(2, pytest.approx(ev_want[0]))]


LOSS = "learners/default_policy/policy_loss"
REWARD = "env_runners/episode_return_mean"


def test_session_logs_every_step_to_wandb_mlflow_and_tensorboard(module_ray, tmp_path):
    """``TrackerSession`` (``ray-xlong train``'s trackers, outside Tune) logs every result to
    W&B, MLflow and TensorBoard, each read back from its own files (in the module's Ray; the
    root conftest's autouse fixture has cleared the trackers' settings)."""
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
