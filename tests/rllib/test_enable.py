"""``ray_xlong.enable`` on real RLlib configs: what the user set survives, what cannot carry over
is named, and the resulting XLongConfig validates into the cell layer's job. No Ray started."""

from __future__ import annotations

import pytest
from ray.rllib.algorithms.algorithm_config import AlgorithmConfig
from ray.rllib.algorithms.appo import APPOConfig
from ray.rllib.algorithms.ppo import PPOConfig
from ray.rllib.callbacks.callbacks import RLlibCallback

import ray_xlong
from ray_xlong.rllib.algorithm import XLongAlgorithm
from ray_xlong.rllib.algorithm_config import AGENT_HARNESS, XLongConfig
from ray_xlong.rllib.enable import EnableError


class CountingCallbacks(RLlibCallback):
    """A user's callbacks class (must survive enabling)."""


def user_piece(input_observation_space, input_action_space):
    """A user's learner connector piece factory (must survive enabling)."""
    return []


def on_result(*, algorithm, result, **kwargs):
    """A user's ``on_train_result`` callable."""


@pytest.fixture
def ppo_config():
    # A PPO job someone already runs: every setting below differs from PPOConfig()'s default.
    return (PPOConfig()
            .training(lr=3e-4, train_batch_size_per_learner=64, grad_clip=0.5, clip_param=0.25,
                      learner_connector=user_piece)
            .callbacks(CountingCallbacks, on_train_result=on_result)
            .env_runners(num_env_runners=3, num_cpus_per_env_runner=2)
            .debugging(seed=7))


def test_ppo_settings_survive(ppo_config, tmp_path):
    cfg = ray_xlong.enable(ppo_config, mode="async", runs_per_group=8, model_dir=str(tmp_path),
                           spool_dir=str(tmp_path / "spool"))
    assert isinstance(cfg, XLongConfig) and cfg.algo_class is XLongAlgorithm
    assert cfg.lr == 3e-4 and cfg.grad_clip == 0.5 and cfg.seed == 7
    assert cfg.total_train_batch_size == 64 and cfg.groups_per_step == 8   # 64 runs = 8 × 8
    assert cfg.callbacks_class is CountingCallbacks
    assert cfg.callbacks_on_train_result is on_result
    assert cfg._learner_connector is user_piece
    assert cfg.num_cells == 3 and cfg.num_cpus_per_env_runner == 2
    assert cfg.xlong_options.loss.clip_low == cfg.xlong_options.loss.clip_high == 0.25
    cfg.validate()
    job = cfg.job_config(group_offset=0)                 # what the cells are built from
    assert job.mode == "async" and job.layout.cells == 3 and job.layout.cpus_per_bundle == 2
    assert job.learner.lr == 3e-4 and job.learner.grad_clip == 0.5
    assert job.job.batch_groups == 8 and job.job.runs_per_group == 8
    assert job.work.seed == 7 and job.spool_dir == str(tmp_path / "spool")
    assert ppo_config.lr == 3e-4 and not isinstance(ppo_config, XLongConfig)   # untouched


def test_appo_settings_survive(tmp_path):
    # A second real config class: APPO (IMPALA family), other knobs changed.
    user = (APPOConfig().training(lr=1e-4, train_batch_size_per_learner=32, grad_clip=2.0)
            .learners(num_learners=2).callbacks(CountingCallbacks))
    cfg = ray_xlong.enable(user, runs_per_group=4, model_dir=str(tmp_path), engine="vllm")
    assert (cfg.lr, cfg.grad_clip, cfg.total_train_batch_size) == (1e-4, 2.0, 32)
    assert cfg.callbacks_class is CountingCallbacks
    assert cfg.num_cells == 2 and cfg.num_learners == 0   # Learners live in the cells
    assert cfg.groups_per_step == 8 and cfg.xlong_options.engine == "vllm"
    cfg.validate()


def test_unchanged_algorithm_config_takes_xlong_defaults(tmp_path):
    cfg = ray_xlong.enable(AlgorithmConfig(), model_dir=str(tmp_path))
    assert (cfg.lr, cfg.grad_clip, cfg.groups_per_step) == (1e-6, 1.0, 16)   # real models
    assert cfg.xlong_options.harness == AGENT_HARNESS


def test_settings_that_cannot_carry_over_are_all_named(tmp_path):
    user = PPOConfig().environment("CartPole-v1").training(lr=1e-3, gamma=0.9,
                                                              entropy_coeff=0.01)
    with pytest.raises(EnableError) as err:
        ray_xlong.enable(user, model_dir=str(tmp_path))
    msg = str(err.value)
    for name in ("env='CartPole-v1'", "gamma=0.9", "entropy_coeff=0.01"):
        assert name in msg
    assert "lr=0.001" not in msg                                           # lr carries
    cfg = ray_xlong.enable(user, ignore=("env", "gamma", "entropy_coeff"),
                           model_dir=str(tmp_path))
    assert cfg.lr == 1e-3


def test_ppo_kl_clip_and_evaluation_settings_carry_over(tmp_path):
    user = (PPOConfig().training(clip_param=0.1, kl_coeff=0.05, train_batch_size_per_learner=16)
            .evaluation(evaluation_interval=3, evaluation_duration=4,
                        evaluation_num_env_runners=1))
    cfg = ray_xlong.enable(user, runs_per_group=8, model_dir=str(tmp_path))
    loss = cfg.xlong_options.loss
    assert (loss.clip_low, loss.clip_high, loss.kl_coef, loss.kl_reference) == \
        (0.1, 0.1, 0.05, "behaviour")
    assert (cfg.evaluation_interval, cfg.evaluation_duration,
            cfg.evaluation_num_env_runners) == (3, 4, 1)
    cfg.validate()
    off = ray_xlong.enable(PPOConfig().training(use_kl_loss=False), model_dir=str(tmp_path))
    assert off.xlong_options.loss.kl_coef == 0.0


@pytest.mark.parametrize("options, field", [
    pytest.param({"mode": "fast"}, "XLongOptions.mode", id="mode"),
    pytest.param({"engine": "trt"}, "XLongOptions.engine", id="engine"),
    pytest.param({"staleness_bound": -1}, "XLongOptions.staleness_bound", id="staleness"),
    pytest.param({"max_trajectories_per_run": 0}, "XLongOptions.max_trajectories_per_run",
                 id="K"),
    pytest.param({"task": "chess"}, "XLongOptions.task", id="task"),
    pytest.param({"colour": "red"}, "unknown xlong options", id="unknown"),
])
def test_bad_options_name_the_field(options, field):
    with pytest.raises(ValueError, match=field):
        ray_xlong.enable(AlgorithmConfig(), **options)


def test_batch_must_be_whole_groups(tmp_path):
    cfg = XLongConfig().training(train_batch_size_per_learner=20).xlong(
        runs_per_group=8, model_dir=str(tmp_path))
    with pytest.raises(ValueError, match="train_batch_size_per_learner"):
        cfg.validate()


def test_cells_and_env_runners_must_agree(tmp_path):
    cfg = XLongConfig().env_runners(num_env_runners=3).xlong(cells=2, model_dir=str(tmp_path))
    with pytest.raises(ValueError, match="num_env_runners"):
        cfg.validate()


def test_model_dir_is_required():
    with pytest.raises(ValueError, match="model_dir"):
        XLongConfig().validate()
