"""Experiment trackers through Ray Tune's logger callbacks, read back from what they wrote:
W&B in offline mode (the run's ``.wandb`` record log), MLflow in a file store (its client), and
TensorBoard (the event file) — driven the way ``ray-xlong train`` does (``TrackerSession``) and,
slow, under ``tune.Tuner`` with a real ``XLongAlgorithm`` (the documented Python way)."""

from __future__ import annotations

import json
import os
import pathlib
import struct
import tempfile

import pytest

pytestmark = [pytest.mark.ray]
ray = pytest.importorskip("ray")
pytest.importorskip("wandb")
pytest.importorskip("mlflow")

from ray_xlong.rllib.trackers import TrackerSession, tracker_callbacks  # noqa: E402
from tests.rllib.test_algorithm_tune import tensorboard_scalars  # noqa: E402

LOSS = "learners/default_policy/policy_loss"
REWARD = "env_runners/episode_return_mean"


def wandb_history(out: pathlib.Path) -> list[dict]:
    """History rows of the (single) offline W&B run under ``out/wandb``: the run file is a
    LevelDB-style log (7-byte file header, 32 KiB blocks, records of crc u32 / len u16 /
    type u8 split FULL=1 / FIRST=2 / MIDDLE=3 / LAST=4) of ``wandb_internal_pb2.Record``."""
    from wandb.proto import wandb_internal_pb2

    (path,) = out.glob("wandb/offline-run-*/run-*.wandb")
    data, pos, buf, rows = path.read_bytes(), 7, b"", []
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:                  # block trailer padding
            pos += 32768 - pos % 32768
            continue
        _, n, kind = struct.unpack("<IHB", data[pos:pos + 7])
        buf = data[pos + 7:pos + 7 + n] if kind in (1, 2) else buf + data[pos + 7:pos + 7 + n]
        pos += 7 + n
        if kind in (1, 4):
            rec = wandb_internal_pb2.Record.FromString(buf)
            if rec.WhichOneof("record_type") == "history":
                rows.append({(i.key or "/".join(i.nested_key)): json.loads(i.value_json)
                             for i in rec.history.item})
    return rows


def mlflow_history(out: pathlib.Path, project: str, key: str) -> list[tuple[int, float]]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=(out / "mlruns").as_uri())
    (run,) = client.search_runs([client.get_experiment_by_name(project).experiment_id])
    return [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, key)]


@pytest.fixture
def local_ray(monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
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


@pytest.mark.slow
@pytest.mark.rllib
def test_tuner_with_tracker_callbacks_logs_the_algorithms_metrics(local_ray, tmp_path):
    """Two iterations of XLongAlgorithm under tune.Tuner with the W&B and MLflow callbacks:
    what they wrote equals the trial's result.json, the evaluation block of iteration 2
    included (run on the rollout cells beside the step, RLlib's parallel mode)."""
    from ray import tune

    from ray_xlong.models import build_tiny_model_dir
    from ray_xlong.rllib.algorithm import XLongAlgorithm
    from ray_xlong.rllib.algorithm_config import XLongConfig

    ray.shutdown()
    ray.init(num_cpus=3, num_gpus=2, include_dashboard=False, log_to_driver=False)
    model_dir = str(build_tiny_model_dir(tmp_path / "policy", seed=0))
    config = (XLongConfig().lookup_recipe().training(train_batch_size_per_learner=4)
              .debugging(seed=0)
              .xlong(mode="elastic", cells=2, runs_per_group=2, slots_per_cell=4,
                     model_dir=model_dir, placement_strategy="PACK", eval_samples=2)
              .evaluation(evaluation_interval=2, evaluation_duration=1,
                          evaluation_num_env_runners=1, evaluation_parallel_to_training=True,
                          evaluation_config={"num_cpus_per_env_runner": 0}))
    out = tmp_path / "trackers"
    grid = tune.Tuner(XLongAlgorithm, param_space=config, run_config=tune.RunConfig(
        name="xl", storage_path=str(tmp_path / "results"), stop={"training_iteration": 2},
        verbose=0, callbacks=tracker_callbacks(("wandb", "mlflow"), project="xl",
                                               out_dir=out))).fit()
    assert grid[0].error is None, grid[0].error
    lines = [json.loads(x) for x in
             (pathlib.Path(grid[0].path) / "result.json").read_text().splitlines()]
    key = "learners/default_policy/entropy"          # > 0 on any trained token
    want = [r["learners"]["default_policy"]["entropy"] for r in lines]
    assert len(want) == 2 and min(want) > 0
    rows = wandb_history(out)
    assert [r["training_iteration"] for r in rows] == [1, 2]
    assert [r[key] for r in rows] == pytest.approx(want)
    history = mlflow_history(out, "xl", key)
    assert [step for step, _ in history] == [1, 2]
    assert [value for _, value in history] == pytest.approx(want)
    # RLlib's evaluation block (iteration 2 only) reaches both trackers under its own keys
    ev_key = "evaluation/env_runners/pass_at_2"
    ev_want = [r["evaluation"]["env_runners"]["pass_at_2"] for r in lines if "evaluation" in r]
    assert len(ev_want) == 1
    assert [r[ev_key] for r in rows if r.get(ev_key) is not None] == pytest.approx(ev_want)
    assert mlflow_history(out, "xl", ev_key) == [(2, pytest.approx(ev_want[0]))]
    assert os.environ.get("WANDB_MODE") == "offline"
