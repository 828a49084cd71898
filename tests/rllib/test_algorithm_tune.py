"""XLongAlgorithm's results reach Ray's loggers the way RLlib users expect: under
``tune.Tuner`` the ``xlong/*`` metrics land in the trial's ``result.json``, ``progress.csv``
and TensorBoard event file (tensorboardX), next to RLlib's own ``env_runners/*`` keys."""

from __future__ import annotations

import csv
import json
import os
import pathlib
import struct
import tempfile

import pytest

pytestmark = [pytest.mark.ray, pytest.mark.rllib, pytest.mark.slow]
ray = pytest.importorskip("ray")
tune = pytest.importorskip("ray.tune")

from ray_xlong.rllib.algorithm import STEP_METRICS, XLONG, XLongAlgorithm  # noqa: E402
from ray_xlong.rllib.algorithm_config import XLongConfig  # noqa: E402

ROLES = ("rollout", "draining", "training", "syncing")
XLONG_KEYS = set(STEP_METRICS) | {f"cells_{r}" for r in ROLES}


def tensorboard_scalars(path: pathlib.Path) -> dict[str, list[tuple[int, float]]]:
    """Scalars of a TensorBoard event file: TFRecords (u64 length, u32 crc, Event, u32 crc)."""
    event_pb2 = pytest.importorskip("tensorboardX.proto.event_pb2")
    data, i, out = path.read_bytes(), 0, {}
    while i < len(data):
        (n,) = struct.unpack("<Q", data[i:i + 8])
        event = event_pb2.Event.FromString(data[i + 12:i + 12 + n])
        i += 12 + n + 4
        for value in event.summary.value:
            out.setdefault(value.tag, []).append((event.step, value.simple_value))
    return out


@pytest.fixture(scope="module")
def trial_dir(tmp_path_factory):
    """Two training iterations of a 2-cell elastic job under ``tune.Tuner``."""
    from ray_xlong.models import build_tiny_model_dir

    if ray.is_initialized():
        ray.shutdown()
    tmp = tmp_path_factory.mktemp("tune")
    os.environ["RAY_TMPDIR"] = tempfile.mkdtemp(prefix="rx", dir="/tmp")  # short socket paths
    model_dir = str(build_tiny_model_dir(tmp / "policy", seed=0))
    # the trial's driver bundle (1 CPU) + two cells (1 CPU, 1 logical GPU each)
    ray.init(num_cpus=3, num_gpus=2, include_dashboard=False, log_to_driver=False)
    config = (XLongConfig().lookup_recipe().training(train_batch_size_per_learner=4)
              .debugging(seed=0)
              .xlong(mode="elastic", cells=2, runs_per_group=2, slots_per_cell=4,
                     model_dir=model_dir, placement_strategy="PACK"))
    try:
        grid = tune.Tuner(XLongAlgorithm, param_space=config, run_config=tune.RunConfig(
            name="xlong", storage_path=str(tmp / "results"),
            stop={"training_iteration": 2}, verbose=0)).fit()
    finally:
        ray.shutdown()
    result = grid[0]
    assert result.error is None, result.error
    assert set(result.metrics[XLONG]) == XLONG_KEYS
    assert result.metrics[XLONG]["policy_version"] == 2
    return pathlib.Path(result.path)


def test_result_json_holds_the_nested_xlong_metrics(trial_dir):
    lines = [json.loads(line) for line in (trial_dir / "result.json").read_text().splitlines()]
    assert [r["training_iteration"] for r in lines] == [1, 2]
    for step, r in enumerate(lines, start=1):
        assert set(r[XLONG]) == XLONG_KEYS and r[XLONG]["policy_version"] == step
        assert r[XLONG]["runs"] == 4 and r["env_runners"]["num_episodes"] == 4
        assert r[XLONG]["unique_tokens"] <= r[XLONG]["total_tokens"]
        assert sum(r[XLONG][f"cells_{role}"] for role in ROLES) == 2


def test_progress_csv_has_a_column_per_metric(trial_dir):
    with open(trial_dir / "progress.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 2
    assert {f"{XLONG}/{k}" for k in XLONG_KEYS} | {"env_runners/episode_return_mean"} \
        <= set(rows[0])


def test_tensorboard_scalars_per_iteration(trial_dir):
    (events,) = trial_dir.glob("events.out.tfevents*")
    scalars = tensorboard_scalars(events)
    for key in XLONG_KEYS:
        assert [step for step, _ in scalars[f"ray/tune/{XLONG}/{key}"]] == [1, 2], key
    assert [v for _, v in scalars[f"ray/tune/{XLONG}/policy_version"]] == [1.0, 2.0]
    assert "ray/tune/env_runners/episode_return_mean" in scalars
