"""Learners on the cell's GPUs from the RLlib config (issue 22 item 5): the single Learner of
the shared algorithm holds its cell's GPUs and the engine settings reach the cells; the config
carries the sharding and device settings, and refuses bad ones by field. That every sharded
rank holds its bundle's GPUs (a sharded algorithm trained on logical GPUs) is
``test_algorithm.py::test_every_sharded_rank_holds_its_bundles_gpus``, in that module's Ray."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.ray
ray = pytest.importorskip("ray")

from algo_helpers import ENGINE_SETTINGS_KW, small_config  # noqa: E402
from ray_xlong.cells.sharding import ShardingSettings  # noqa: E402
from ray_xlong.rollout.engine_settings import EngineSettings  # noqa: E402


@pytest.mark.slow
def test_the_single_learner_holds_its_cells_gpu(trained_algo):
    # the shared algorithm (tests/rllib/conftest.py): 2 cells × 1 bundle of 2 logical GPUs
    assert all(s == EngineSettings(**ENGINE_SETTINGS_KW)          # the engine settings reach
               for s in trained_algo.engine_settings)              # the cells
    ids = trained_algo.learner_gpus
    assert [len(i) for i in ids] == [2, 2] and sorted(sum(ids, [])) == ["0", "1", "2", "3"]
    assert trained_algo.runner_gpus == [[], []]
    assert trained_algo.results[0]["xlong"]["policy_version"] == 1


def test_xlong_and_enable_carry_the_sharding_and_device_settings():
    from ray.rllib.algorithms.ppo import PPOConfig

    from ray_xlong.rllib.enable import enable

    sharding = ShardingSettings(ranks_per_cell=4, device="cuda", mixed_precision="bf16")
    engines = EngineSettings(max_model_len=131072, tensor_parallel_size=2, enforce_eager=False)
    for config in (small_config("/m").xlong(gpus_per_node=4, sharding=sharding,
                                            context_parallel=2, attn_implementation="sdpa",
                                            engine_settings=engines),
                   enable(PPOConfig().training(lr=1e-5), model_dir="/m", gpus_per_node=4,
                          sharding=sharding, context_parallel=2, attn_implementation="sdpa",
                          engine_settings=engines)):
        assert config.xlong_options.engine_settings == engines
        job = config.job_config(group_offset=0)
        assert job.sharding == sharding and job.layout.gpus_per_node == 4
        assert (job.learner.context_parallel, job.learner.attn_implementation) == (2, "sdpa")


@pytest.mark.parametrize("kwargs,field", [
    pytest.param(dict(sharding={"ranks_per_cell": 2}), "sharding", id="not-a-record"),
    pytest.param(dict(context_parallel=0), "context_parallel", id="cp-0"),
    pytest.param(dict(attn_implementation="fast"), "attn_implementation", id="attention"),
    pytest.param(dict(engine_settings={"max_model_len": 8192}), "engine_settings",
                 id="engine-settings-not-a-record"),
])
def test_bad_learner_settings_name_the_field(kwargs, field):
    from ray_xlong.rllib.algorithm_config import XLongConfig

    with pytest.raises(ValueError, match=f"XLongOptions.{field}"):
        XLongConfig().xlong(model_dir="/m", **kwargs)


def test_a_rank_count_the_cells_gpus_cannot_hold_is_refused_before_anything_starts():
    from ray_xlong.cells.sharding import ShardingError

    config = small_config("/m").xlong(gpus_per_node=2,
                                      sharding=ShardingSettings(ranks_per_cell=4, device="cuda"))
    with pytest.raises(ShardingError, match="ranks_per_cell=4"):
        config.validate()
