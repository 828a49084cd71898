"""XLongAlgorithm on a local Ray: ``train()`` drives the cells one step at a time and returns
RLlib-style metrics, user callbacks fire, checkpoints restore in a new process at the same
iteration, policy version and task position, a task defined in the user's script reaches every
cell (by factory; by a name registered in the driver), RLlib's ``.evaluation`` adds held-out
results at its interval, and (slow) the reward rises on the learnable task. Learners on the
cells' GPUs when sharded (issue 22 item 5), and the bare ``AgentEnvRunner`` as a Ray actor.

Every algorithm here (the shared one when this process builds it, the restored one of the new
process, which joins this Ray, the sharded, learning and colocated ones) runs in one module Ray
of 2 CPUs and 4 logical GPUs, started once (each ``ray.init`` costs ~12 s of CPU)."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import tempfile
import textwrap

import numpy as np
import pytest

pytestmark = pytest.mark.ray
ray = pytest.importorskip("ray")

from algo_helpers import SHARED_RAY, RecordingCallbacks, small_config, user_task  # noqa: E402
from ray_xlong.rllib.algorithm_config import RECIPE_HARNESS, XLongConfig  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def local_ray(tmp_path_factory):
    """The module's Ray (module docstring): the shared algorithm's size (``SHARED_RAY``)."""
    if ray.is_initialized():
        ray.shutdown()
    tmp = tempfile.mkdtemp(prefix="rx", dir="/tmp")   # short: Ray's socket paths fit 107 bytes
    os.environ["RAY_TMPDIR"] = tmp
    ray.init(**SHARED_RAY)
    yield tmp
    ray.shutdown()


@pytest.fixture(scope="module")
def plain_model(tmp_path_factory):
    from ray_xlong.models import build_tiny_model_dir

    return str(build_tiny_model_dir(tmp_path_factory.mktemp("m") / "policy", seed=0))


@pytest.fixture(scope="module")
def trained(local_ray, request):
    """The shared trained algorithm (``conftest.trained_algo``, built in the module's Ray when
    this process builds it: asked for once that Ray is up, as pytest would set a session
    fixture up before a module one) as it was after two steps: their results, its checkpoint
    and the Learner's weights then."""
    trained_algo = request.getfixturevalue("trained_algo")
    return trained_algo.results[:2], trained_algo.checkpoint, trained_algo.weights


@pytest.mark.slow
def test_train_returns_rllib_metrics(trained):
    results, _, _ = trained
    for step, r in enumerate(results, start=1):
        assert r["training_iteration"] == step
        x = r["xlong"]
        assert x["policy_version"] == step and x["runs"] == 8
        assert r["env_runners"]["num_episodes"] == 8
        assert 0.0 <= r["env_runners"]["episode_return_mean"] <= 1.0
        assert x["tokens_trained"] > 0 and x["unique_tokens"] <= x["total_tokens"]
        assert x["trajectories_kept"] >= 8 and x["trajectories_dropped"] >= 0
        assert 0 <= x["staleness_max"] <= 1                    # the default bound
        assert sum(x[f"cells_{r}"] for r in ("rollout", "draining", "training",
                                             "syncing")) == 2
        assert 0.0 < x["gpu_busy_frac"] <= 1.0


@pytest.mark.slow
def test_evaluation_results_come_at_the_interval_and_pass_rllibs_check(trained):
    """``.evaluation(evaluation_interval=2, evaluation_duration=2)``: iteration 1 has no
    ``evaluation`` block, iteration 2 has RLlib's ``evaluation/env_runners/...`` with the
    held-out runs of the user's task; both results pass RLlib's own result check."""
    from ray.rllib.utils.test_utils import check_train_results_new_api_stack

    results, _, _ = trained
    assert "evaluation" not in results[0]
    ev = results[1]["evaluation"]["env_runners"]
    assert (ev["num_instances"], ev["num_episodes"], ev["policy_version"]) == (2, 4, 2)
    assert 0.0 <= ev["pass_at_1"] <= ev["pass_at_2"] <= 1.0
    assert ev["episode_return_min"] <= ev["episode_return_mean"] <= ev["episode_return_max"]
    for r in results:
        check_train_results_new_api_stack(r)


@pytest.mark.slow
def test_user_callbacks_fire(trained, trained_algo):
    assert trained_algo.callbacks_seen == [("init", None), ("result", 1), ("result", 2)]


FROM_CHECKPOINT = textwrap.dedent("""
    import json, os, sys
    import ray, torch
    from ray_xlong.rllib.algorithm import XLongAlgorithm
    path, out, module, module_root, address = sys.argv[1:6]
    try:                           # the saved config names the test's callbacks class
        XLongAlgorithm.from_checkpoint(path)
        error = ""
    except ValueError as exc:
        error = str(exc)
    sys.path.insert(0, module_root)
    ray.init(address=address, log_to_driver=False)       # the test's Ray: 4 logical GPUs
    algo = XLongAlgorithm.from_checkpoint(path)
    restored = [algo.training_iteration, algo.policy_version]
    before = algo.get_state()["xlong"]
    saved = torch.load(os.path.join(out, "saved.pt"))
    held = ray.get(algo._holder().get_weights.remote())  # a Learner loaded the DCP checkpoint
    same = all(torch.equal(held[k], v) for k, v in saved.items()) and held.keys() == saved.keys()
    r = algo.train()
    json.dump({"error": error, "restored": restored, "weights_equal": same,
               "version_restored": before["policy_version"],
               "data_position": before["data_position"],
               "iteration": r["training_iteration"],
               "version": r["xlong"]["policy_version"],
               "first_version_trained_on": algo.reports[0].version - 1,
               "data_position_after": algo.data_position,
               "callbacks": sys.modules[module].RecordingCallbacks.seen},
              open(os.path.join(out, "r.json"), "w"))
    algo.stop()
""")


@pytest.mark.slow
def test_from_checkpoint_continues_in_a_new_process(trained, tmp_path):
    """In a new process ``XLongAlgorithm.from_checkpoint`` builds from the saved config
    (callbacks included), restores the saved weights and version exactly (``restore_from_path``)
    and trains on at the next step and version; a saved class that does not import is named.
    The new process is a driver of its own, joining the module's Ray (its cells are its own)."""
    import torch

    _, path, weights = trained
    torch.save(weights, tmp_path / "saved.pt")
    module = RecordingCallbacks.__module__
    module_root = pathlib.Path(sys.modules[module].__file__).parents[module.count(".")]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    address = ray.get_runtime_context().gcs_address
    proc = subprocess.run([sys.executable, "-c", FROM_CHECKPOINT, str(path), str(tmp_path),
                           module, str(module_root), address], env=env, cwd=tmp_path,
                          timeout=300, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads((tmp_path / "r.json").read_text())
    assert "cannot load the saved config" in got.pop("error")
    # trained: 2 steps, so the restored algorithm is at iteration 2, version 2 and steps on
    # data_position: 2 steps × 2 groups drawn before the save: the restored job goes on
    # there (groups 4 and 5 in its first step)
    assert got == {"restored": [2, 2], "weights_equal": True, "version_restored": 2,
                   "data_position": 4, "data_position_after": 6,
                   "iteration": 3, "version": 3,
                   "first_version_trained_on": 2, "callbacks": [["init", None], ["result", 3]]}


@pytest.mark.slow
def test_reward_rises_in_elastic_mode(local_ray, warm_cache):
    """The lookup recipe (warm start, lr 5e-4, 16 groups × 8 runs) on 2 elastic cells: the
    mean reward of steps 8-12 beats that of steps 1-3 by >= 0.3 (measured: 0.36 -> 0.80; the
    25-step curve went on to 0.93 at step 25, so the last 13 steps added CI time, not proof)."""
    from ray_xlong.cells.task_job import warm_started_model_dir

    model_dir = warm_started_model_dir(warm_cache, seed=1)
    algo = (XLongConfig().debugging(seed=1).lookup_recipe()
            .xlong(mode="elastic", cells=2, model_dir=model_dir, placement_strategy="PACK")
            .build_algo())
    try:
        rewards = [algo.train()["env_runners"]["episode_return_mean"] for _ in range(12)]
    finally:
        algo.stop()
    rise = float(np.mean(rewards[-5:]) - np.mean(rewards[:3]))
    assert rise >= 0.3, rewards


@pytest.mark.slow
def test_a_users_learner_connector_piece_runs_on_the_training_batch(local_ray, plain_model):
    """Issue 11: a learner connector piece the user added to their config runs in the cells'
    Learner connector pipeline, before PrefixTreeConnector builds the module batch (RLlib's
    order: custom pieces, then the batch builder), on the episodes of the runs trained.

    The job is colocated with RLlib's evaluation every iteration: every cell trains at once, so
    no cell hosts evaluation while a step trains; evaluation lets the step apply (instead of
    waiting out its timeout) and the next ``train()`` reports that step at once: every round
    is complete and versions go 1, 2, 3 (one job for both claims: building and training one
    costs ~40 s of CI)."""
    import ray_xlong
    from ray.rllib.algorithms.ppo import PPOConfig
    from ray.rllib.connectors.connector_v2 import ConnectorV2
    from ray.rllib.core import DEFAULT_MODULE_ID

    class MarkingPiece(ConnectorV2):  # local: pickled by value to the learner actors
        def __call__(self, *, rl_module, batch, episodes, explore=None, shared_data=None,
                     metrics=None, **kwargs):
            metrics.log_value(("user_piece", "calls"), 1, reduce="sum")
            metrics.log_value(("user_piece", "episodes"), len(episodes), reduce="sum")
            metrics.log_value(("user_piece", "before_batch"), int(DEFAULT_MODULE_ID not in batch),
                              reduce="sum")
            return batch

    from ray_xlong.rollout.tasks import TASKS, register_task

    register_task("echo_by_name", user_task())    # registered in the driver only
    mine = (PPOConfig().training(lr=1e-4, train_batch_size_per_learner=8,
                                 learner_connector=lambda obs, act: MarkingPiece())
            .env_runners(num_env_runners=2).debugging(seed=0)
            .evaluation(evaluation_interval=1, evaluation_duration=2,
                        evaluation_sample_timeout_s=600))
    algo = ray_xlong.enable(mine, mode="colocated", runs_per_group=4, slots_per_cell=8,
                            harness=RECIPE_HARNESS, task="echo_by_name", eval_samples=2,
                            model_dir=plain_model, placement_strategy="PACK").build_algo()
    try:
        results = [algo.train() for _ in range(3)]         # the task reached every cell
        result = results[-1]
        keys = ("calls", "episodes", "before_batch")
        seen = [ray.get(c.learner.__ray_call__.remote(
            lambda self: {k: self.metrics.peek(("user_piece", k), default=0) for k in keys}))
            for c in algo.pool.cells]
    finally:
        algo.stop()
        TASKS.pop("echo_by_name")
    total = {k: sum(s[k] for s in seen) for k in keys}
    trained = result["env_runners"]["num_episodes"]
    assert [r["env_runners"]["num_episodes"] for r in results] == [8, 8, 8]
    assert trained == 8 and total["episodes"] >= trained     # every trained run went through it
    assert total["calls"] >= 1 and total["before_batch"] == total["calls"]
    assert [r["xlong"]["policy_version"] for r in results] == [1, 2, 3]
    assert [r["xlong"]["runs"] for r in results] == [8, 8, 8]
    assert [r["evaluation"]["env_runners"]["num_episodes"] for r in results] == [4, 4, 4]


@pytest.mark.slow
def test_every_sharded_rank_holds_its_bundles_gpus(local_ray, plain_model):
    """``.xlong(sharding=..., gpus_per_node=...)`` reaches the cells: every Learner rank holds
    its bundle's GPUs in Ray's accounting (``ray.get_gpu_ids()`` inside the rank), the runner
    asks for none and is pinned to them, and on logical GPUs (no CUDA) the ranks still train
    on the CPU (moved from ``test_learner_gpus.py``: it shares this module's Ray)."""
    from ray_xlong.cells.sharded_cell import ShardedCell
    from ray_xlong.cells.sharding import ShardingSettings

    def held(actor) -> list[str]:
        return [str(i) for i in ray.get(actor.__ray_call__.remote(
            lambda self: ray.get_gpu_ids()))]

    def inside(actor, fn):
        return ray.get(actor.__ray_call__.remote(fn))

    # 2 cells × 1 bundle of 2 GPUs, 2 ranks a cell: each rank holds one GPU of its cell's bundle
    config = small_config(plain_model).xlong(
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
def test_runner_as_a_ray_actor(local_ray, plain_model):
    """``AgentEnvRunner`` as a Ray actor of its own, configured by RLlib's ``env_config``
    (``xlong_rollout``): runs start, end and come back as episodes through Ray (moved from
    ``test_env_runner.py``, whose other tests need no Ray: it shares this module's Ray)."""
    from algo_helpers import scripted_factory
    from ray.rllib.algorithms.ppo import PPOConfig

    from ray_xlong.rllib.env_runner import AgentEnvRunner, RolloutConfig, RunSpec
    from ray_xlong.rllib.episodes import runs_from_episodes
    from ray_xlong.rollout import HarnessConfig

    cfg = PPOConfig().environment(env_config={"xlong_rollout": RolloutConfig(
        model_dir=plain_model, harness=HarnessConfig(max_new_tokens=16),
        engine_factory=scripted_factory(plain_model))})
    actor = ray.remote(num_cpus=1)(AgentEnvRunner).remote(config=cfg)
    specs = [RunSpec("arithmetic", 7, f"gr{i}", "g") for i in range(3)]
    ray.get(actor.start_runs.remote(specs))
    episodes = ray.get(actor.sample.remote(min_runs=3, timeout_s=60))
    runs = runs_from_episodes(episodes)
    assert len(runs) == 3 and all(r.reward == 1.0 for r in runs)
    assert np.all([c.output_ids.size > 0 for r in runs for c in r.calls])
    ray.get(actor.stop.remote())
    ray.kill(actor)
