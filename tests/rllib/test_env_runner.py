"""AgentEnvRunner: runs start, stay live, end into episodes; drain, sleep / wake, weights.

Built directly (no Ray cluster: the runner's logic is the same inside an actor); as a Ray actor
in ``test_algorithm.py::test_runner_as_a_ray_actor`` (that module's Ray).
"""

from __future__ import annotations

import numpy as np
import pytest
from algo_helpers import scripted_factory
from ray.rllib.algorithms.ppo import PPOConfig

from ray_xlong.models import build_tiny_model_dir, load_model
from ray_xlong.rllib.env_runner import AgentEnvRunner, RolloutConfig, RunSpec
from ray_xlong.rllib.episodes import runs_from_episodes
from ray_xlong.rollout import HarnessConfig
from ray_xlong.rollout.tasks import UnknownTaskError

pytestmark = pytest.mark.rllib


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(build_tiny_model_dir(tmp_path_factory.mktemp("runner") / "m", seed=0))


def make_runner(model_dir, **kw):
    cfg = RolloutConfig(model_dir=model_dir, harness=HarnessConfig(max_new_tokens=16), **kw)
    return AgentEnvRunner(config=PPOConfig(), rollout_config=cfg)


def specs(n, group="g"):
    return [RunSpec("arithmetic", 7, f"{group}r{i}", group) for i in range(n)]


def test_runs_end_into_episodes_exactly_once(model_dir):
    runner = make_runner(model_dir, engine_factory=scripted_factory(model_dir))
    try:
        runner.start_runs(specs(4))
        episodes = runner.sample(min_runs=4, timeout_s=30)
        runs = runs_from_episodes(episodes)
        assert sorted(r.run_id for r in runs) == ["gr0", "gr1", "gr2", "gr3"]
        assert all(r.status == "finished" and r.reward == 1.0 for r in runs)
        assert runner.num_live_runs() == 0 and runner.sample() == []
        assert runner.get_metrics()["engine"]["requests"] == 8
    finally:
        runner.stop()


@pytest.mark.slow
def test_drain_sleep_wake_and_weights_with_the_hf_engine(model_dir):
    runner = make_runner(model_dir)
    try:
        runner.start_runs(specs(2))
        assert runner.num_live_runs() == 2
        runner.drain()
        with pytest.raises(RuntimeError, match="no new runs"):
            runner.start_runs(specs(1, "h"))
        with pytest.raises(RuntimeError, match="live runs"):
            runner.sleep()                                   # never interrupts a live run
        runs = runs_from_episodes(runner.sample(min_runs=2, timeout_s=60))
        assert len(runs) == 2 and runner.num_live_runs() == 0
        runner.sleep()
        new = {k: v * 1.01 for k, v in load_model(model_dir).state_dict().items()}
        runner.set_weights(new, version=2)
        runner.wake_up()
        runner.undrain()
        runner.start_runs(specs(1, "h"))
        (run,) = runs_from_episodes(runner.sample(min_runs=1, timeout_s=60))
        assert {c.policy_version for c in run.calls} == {2} and runner.policy_version == 2
    finally:
        runner.stop()


def test_bad_config_and_unknown_task_raise(model_dir):
    with pytest.raises(ValueError, match="RolloutConfig.backend"):
        RolloutConfig(model_dir=model_dir, backend="tgi")
    with pytest.raises(ValueError, match="RolloutConfig"):
        AgentEnvRunner(config=PPOConfig())
    runner = make_runner(model_dir, engine_factory=scripted_factory(model_dir))
    try:
        with pytest.raises(UnknownTaskError, match="nope"):
            runner.start_runs([RunSpec("nope", 0, "x", "g")])
        assert runner.num_live_runs() == 0
    finally:
        runner.stop()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_engine_loads_the_learners_dtype(model_dir, dtype):
    import torch

    runner = make_runner(model_dir, dtype=dtype)
    try:
        want = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
        assert {p.dtype for p in runner.engine.engines[0].model.parameters()} == {want}
    finally:
        runner.stop()


def test_a_dtype_the_backend_cannot_load_names_the_field(model_dir):
    with pytest.raises(ValueError, match=r"RolloutConfig\.dtype .*'vllm'"):
        RolloutConfig(model_dir=model_dir, backend="vllm", dtype="float64")
    with pytest.raises(ValueError, match=r"RolloutConfig\.dtype"):
        RolloutConfig(model_dir=model_dir, dtype="int8")
