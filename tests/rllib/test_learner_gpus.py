"""Learners on the cell's GPUs from the RLlib config (issue 22 item 5): ``.xlong(sharding=...,
gpus_per_node=...)`` reaches the cells, every Learner rank holds its bundle's GPUs in Ray's
accounting (``ray.get_gpu_ids()`` inside the rank), the runner asks for none and is pinned to
them, and on logical GPUs (no CUDA) the ranks still train on the CPU."""

from __future__ import annotations

import os
import tempfile

import pytest

pytestmark = pytest.mark.ray
ray = pytest.importorskip("ray")

from algo_helpers import ENGINE_SETTINGS_KW, small_config  # noqa: E402
from ray_xlong.cells.sharded_cell import ShardedCell  # noqa: E402
from ray_xlong.cells.sharding import ShardingSettings  # noqa: E402
from ray_xlong.rollout.engine_settings import EngineSettings  # noqa: E402


def held(actor) -> list[str]:
    """Ray GPU ids ``actor`` holds (asked inside it)."""
    return [str(i) for i in ray.get(actor.__ray_call__.remote(lambda self: ray.get_gpu_ids()))]


def inside(actor, fn):
    return ray.get(actor.__ray_call__.remote(fn))


@pytest.fixture
def model_dir(tmp_path):
    from ray_xlong.models import build_tiny_model_dir

    return str(build_tiny_model_dir(tmp_path / "policy", seed=0))


@pytest.fixture
def logical_gpus():
    if ray.is_initialized():
        ray.shutdown()
    os.environ["RAY_TMPDIR"] = tempfile.mkdtemp(prefix="rx", dir="/tmp")   # short socket paths
    ray.init(num_cpus=2, num_gpus=4, include_dashboard=False, log_to_driver=False)
    yield 4
    ray.shutdown()


@pytest.mark.slow
def test_every_sharded_rank_holds_its_bundles_gpus(logical_gpus, model_dir):
    # 2 cells × 1 bundle of 2 GPUs, 2 ranks a cell: each rank holds one GPU of its cell's bundle
    config = small_config(model_dir).xlong(
        gpus_per_node=2, sharding=ShardingSettings(ranks_per_cell=2, device="cpu"))
    algo = config.build_algo()
    try:
        result = algo.train()                      # the ranks train (on the CPU: no CUDA)
        assert result["xlong"]["policy_version"] == 1 and result["xlong"]["tokens_trained"] > 0
        by_cell = []
        for cell in algo.pool.cells:
            assert isinstance(cell.learner, ShardedCell) and len(cell.learner.ranks) == 2
            ids = [held(rank) for rank in cell.learner.ranks]
            assert [len(i) for i in ids] == [1, 1] and ids[0] != ids[1]
            by_cell.append(sorted(i[0] for i in ids))
            assert held(cell.runner) == []             # the runner asks Ray for no GPU ...
            visible = inside(cell.runner, lambda self: os.environ["CUDA_VISIBLE_DEVICES"])
            assert visible == ",".join(by_cell[-1])    # ... and sees its Learner's
            assert {inside(r, lambda self: str(self.device)) for r in cell.learner.ranks} \
                == {"cpu"}
        assert sorted(g for ids in by_cell for g in ids) == ["0", "1", "2", "3"]
    finally:
        algo.stop()


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
