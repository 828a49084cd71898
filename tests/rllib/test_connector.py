"""PrefixTreeConnector inside RLlib's own learner connector pipeline (and a real Learner).

Pipelines are built the way a Learner builds them: ``config.build_learner_connector(...)`` on an
``AlgorithmConfig`` whose ``learners(learner_connector=...)`` returns the piece, then called with
the Learner's arguments (a real MultiRLModule, episodes, a MetricsLogger). No Ray cluster.
Also covers ``episodes.py`` (the run ↔ episode envelope).
"""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch
from ray.rllib.algorithms.ppo import PPOConfig
from ray.rllib.core import DEFAULT_MODULE_ID
from ray.rllib.core.rl_module.multi_rl_module import MultiRLModuleSpec
from ray.rllib.core.rl_module.rl_module import RLModuleSpec
from ray.rllib.core.rl_module.torch.torch_rl_module import TorchRLModule
from ray.rllib.env.single_agent_episode import SingleAgentEpisode
from ray.rllib.utils.metrics.metrics_logger import MetricsLogger

from ray_xlong.rllib.connector import (DEDUP_RATIO_KEY, METRIC_KEYS, TENSOR_KEYS,
                                       PrefixTreeConnector, batch_from_packed, packed_from_batch)
from ray_xlong.rllib.episodes import (RUN_ACTION_SPACE, RUN_KEY, RUN_OBSERVATION_SPACE,
                                      EpisodeError, run_to_episode, runs_from_episodes)
from ray_xlong.trajectory import (AgentRun, ModelCall, PackedBatch, ProcessorConfig, RecordError,
                                  TrajectoryProcessor)

pytestmark = pytest.mark.rllib

# Token ids that read as the conversation: context words ≥ 100, generated words < 100.
SYS, TASK, TOOL, SUMMARIZE = 100, 101, 102, 103
PLAN, EDIT, TEST, DONE, BAD, SUM = 1, 2, 3, 4, 5, 6


def call(cid, inp, out, *, kind="main", agent="main", version=0):
    return ModelCall(cid, agent, kind, list(inp), list(out), [-0.5] * len(out), version)


def branching_run(run_id, *, group="g", reward=1.0, status="finished"):
    """main: SYS TASK >PLAN >EDIT TOOL >TEST; a retry after PLAN (>BAD); a summary call.

    3 trajectories (main, retry, summary) sharing SYS TASK PLAN."""
    return AgentRun(run_id, group, [
        call("c0", [SYS, TASK], [PLAN, EDIT], version=1),
        call("c1", [SYS, TASK, PLAN, EDIT, TOOL], [TEST, DONE], version=2),
        call("c2", [SYS, TASK, PLAN], [BAD], version=2),
        call("c3", [SYS, TASK, PLAN, EDIT, SUMMARIZE], [SUM], kind="summary", agent="sum"),
    ], reward, status)


def runs():
    """Group g: two trained runs (one timed out) and a failed one; group h: one run."""
    return [branching_run("r0", reward=1.0),
            branching_run("r1", reward=0.0, status="timeout"),
            branching_run("r2", reward=0.5, status="failed"),
            AgentRun("r3", "h", [call("c0", [SYS, TASK], [DONE])], 1.0, "finished")]


class NullModule(TorchRLModule):
    """The Learner passes its MultiRLModule to the pipeline; the piece never uses it."""

    def setup(self):
        pass

    def _forward(self, batch, **kwargs):
        return {}


def learner_config(pcfg=ProcessorConfig(), *, defaults=False):
    return PPOConfig().learners(
        learner_connector=lambda obs_space, act_space: PrefixTreeConnector(config=pcfg),
        add_default_connectors_to_learner_pipeline=defaults)


def multi_module(*module_ids):
    spec = RLModuleSpec(module_class=NullModule, observation_space=RUN_OBSERVATION_SPACE,
                        action_space=RUN_ACTION_SPACE)
    return MultiRLModuleSpec(rl_module_specs={m: spec for m in module_ids}).build()


def run_pipeline(config, episodes, *, module_ids=(DEFAULT_MODULE_ID,), metrics=None):
    pipeline = config.build_learner_connector(input_observation_space=None,
                                              input_action_space=None)
    return pipeline(rl_module=multi_module(*module_ids), batch={}, episodes=episodes,
                    shared_data={}, metrics=metrics)


def assert_same_packed(got: PackedBatch, want: PackedBatch):
    assert got.layout == want.layout
    assert got.run_ids == want.run_ids
    for key in TENSOR_KEYS:
        a, b = getattr(got, key), getattr(want, key)
        assert a.dtype == b.dtype and torch.equal(a, b), key


# ---------------------------------------------------------------- pipeline from config


@pytest.mark.parametrize("pcfg", [
    pytest.param(ProcessorConfig(), id="tree"),
    pytest.param(ProcessorConfig(pack="per_trajectory"), id="per_trajectory"),
    pytest.param(ProcessorConfig(max_trajectories_per_run=2, row_tokens=None,
                                 normalize_std=True, loss_norm="run"), id="cap2-run-norm"),
])
def test_pipeline_batch_equals_processor(pcfg):
    batch = run_pipeline(learner_config(pcfg), [run_to_episode(r) for r in runs()])
    want = TrajectoryProcessor(pcfg).process(runs()).packed
    assert set(batch) == {DEFAULT_MODULE_ID}
    assert set(batch[DEFAULT_MODULE_ID]) == {*TENSOR_KEYS, "layout", "run_ids"}
    assert all(isinstance(v, torch.Tensor) for v in batch[DEFAULT_MODULE_ID].values())
    assert_same_packed(packed_from_batch(batch[DEFAULT_MODULE_ID]), want)
    assert want.run_ids == ("r0", "r1", "r3")  # r2 failed: not trained


def test_pipeline_logs_processor_stats():
    metrics = MetricsLogger()
    run_pipeline(learner_config(), [run_to_episode(r) for r in runs()], metrics=metrics)
    result = TrajectoryProcessor(ProcessorConfig()).process(runs())
    logged = metrics.peek((DEFAULT_MODULE_ID,))
    for field, key in METRIC_KEYS.items():
        source = result.packed if field in ("num_targets", "num_positions") else result.stats
        assert logged[key] == getattr(source, field), key
    assert logged[DEDUP_RATIO_KEY] == pytest.approx(result.stats.dedup_ratio)
    # r0, r1 share nothing across runs; within a run the 3 trajectories share SYS TASK PLAN.
    assert logged["xlong/runs_failed"] == 1 and logged["xlong/runs_timeout"] == 1
    assert logged["xlong/total_tokens"] > logged["xlong/unique_tokens"]


def test_pipeline_with_default_pieces_on_still_round_trips():
    """RLlib's defaults run after the piece and only add placeholder columns."""
    batch = run_pipeline(learner_config(defaults=True), [run_to_episode(r) for r in runs()])
    want = TrajectoryProcessor(ProcessorConfig()).process(runs()).packed
    assert {"obs", "actions", "rewards"} <= set(batch[DEFAULT_MODULE_ID])
    assert_same_packed(packed_from_batch(batch[DEFAULT_MODULE_ID]), want)


def test_pipeline_one_batch_per_module():
    episodes = [run_to_episode(r, module_id="a" if r.group_id == "g" else "b") for r in runs()]
    batch = run_pipeline(learner_config(), episodes, module_ids=("a", "b"))
    processor = TrajectoryProcessor(ProcessorConfig())
    assert_same_packed(packed_from_batch(batch["a"]), processor.process(runs()[:3]).packed)
    assert_same_packed(packed_from_batch(batch["b"]), processor.process(runs()[3:]).packed)


def test_pipeline_without_episodes_leaves_batch_empty():
    metrics = MetricsLogger()
    assert run_pipeline(learner_config(), [], metrics=metrics) == {}
    assert DEFAULT_MODULE_ID not in metrics.reduce()


# ---------------------------------------------------------------- bad input


def test_episode_without_run_is_named():
    bare = SingleAgentEpisode(id_="eps-bare")
    bare.add_env_reset(observation=np.zeros(1, np.float32))
    bare.add_env_step(observation=np.zeros(1, np.float32), action=0, reward=0.0,
                      terminated=True)
    with pytest.raises(EpisodeError, match=r"episode 'eps-bare' carries no agent run"):
        run_pipeline(learner_config(), [run_to_episode(runs()[0]), bare])


@pytest.mark.parametrize("payload, match", [
    pytest.param({"run_id": "r9"}, r"episode 'r0'.*is a dict, not an AgentRun", id="dict"),
    pytest.param("r0", r"episode 'r0'.*is a str, not an AgentRun", id="str"),
])
def test_malformed_run_payload_is_named(payload, match):
    episode = run_to_episode(runs()[0])
    episode.custom_data[RUN_KEY] = payload
    with pytest.raises(EpisodeError, match=match):
        run_pipeline(learner_config(), [episode])


def test_duplicate_run_is_named():
    with pytest.raises(RecordError, match=r"run 'r0': run_id is duplicated"):
        run_pipeline(learner_config(), [run_to_episode(runs()[0]), run_to_episode(runs()[0])])


def test_unfinished_episode_is_named():
    episode = SingleAgentEpisode(id_="eps-live")
    episode.add_env_reset(observation=np.zeros(1, np.float32))
    episode.custom_data[RUN_KEY] = runs()[0]
    with pytest.raises(EpisodeError, match=r"episode 'eps-live' \(run 'r0'\) is not done"):
        run_pipeline(learner_config(), [episode])


def test_group_split_over_modules_is_named():
    r0, r1 = runs()[:2]
    episodes = [run_to_episode(r0, module_id="a"), run_to_episode(r1, module_id="b")]
    with pytest.raises(EpisodeError, match=r"group 'g' is split over modules 'a' and 'b'"):
        run_pipeline(learner_config(), episodes, module_ids=("a", "b"))


def test_module_already_in_batch_is_named():
    piece = PrefixTreeConnector()
    with pytest.raises(ValueError, match=r"already has an entry for module 'default_policy'"):
        piece(rl_module=None, batch={DEFAULT_MODULE_ID: {}}, episodes=[run_to_episode(runs()[0])])


@pytest.mark.parametrize("kwargs, error, match", [
    pytest.param({"config": ProcessorConfig(pack="none")}, ValueError, r"config\.pack",
                 id="pack-none"),
    pytest.param({"config": {"pack": "tree"}}, TypeError, r"config must be a ProcessorConfig",
                 id="dict-config"),
])
def test_bad_connector_config(kwargs, error, match):
    with pytest.raises(error, match=match):
        PrefixTreeConnector(**kwargs)


def test_packed_from_batch_names_missing_and_bad_fields():
    good = batch_from_packed(TrajectoryProcessor().process(runs()).packed)
    with pytest.raises(KeyError, match="target_ids"):
        packed_from_batch({k: v for k, v in good.items() if k != "target_ids"})
    with pytest.raises(TypeError, match="loss_scale must be a torch.Tensor"):
        packed_from_batch({**good, "loss_scale": good["loss_scale"].numpy()})


# ---------------------------------------------------------------- round trips


@pytest.mark.parametrize("pack", ["tree", "per_trajectory"])
def test_packed_batch_round_trip(pack):
    packed = TrajectoryProcessor(ProcessorConfig(pack=pack)).process(runs()).packed
    assert_same_packed(packed_from_batch(batch_from_packed(packed)), packed)


def test_run_ids_survive_any_characters():
    run = AgentRun('ü "x"\n,]', "g", [call("c0", [SYS], [DONE])], 1.0, "finished")
    packed = TrajectoryProcessor().process([run]).packed
    assert packed_from_batch(batch_from_packed(packed)).run_ids == ('ü "x"\n,]',)


def test_connector_ctor_args_restore_it():
    pcfg = ProcessorConfig(max_trajectories_per_run=3, pack="per_trajectory")
    args, kwargs = PrefixTreeConnector(config=pcfg).get_ctor_args_and_kwargs()
    assert PrefixTreeConnector(*args, **kwargs).config == pcfg


@pytest.mark.parametrize("status, terminated, truncated", [
    ("finished", True, False), ("timeout", False, True), ("failed", False, True)])
def test_run_episode_is_valid_done_and_carries_the_run(status, terminated, truncated):
    run = branching_run("r0", reward=0.25, status=status)
    episode = run_to_episode(run)
    episode.validate()
    assert (episode.id_, len(episode), episode.get_return()) == ("r0", 1, 0.25)
    assert (episode.is_terminated, episode.is_truncated) == (terminated, truncated)
    assert episode.custom_data[RUN_KEY] is run  # not copied
    episode.to_numpy()
    restored = [pickle.loads(pickle.dumps(episode)),
                SingleAgentEpisode.from_state(episode.get_state())]
    assert [r.run_id for r in runs_from_episodes(restored)] == ["r0", "r0"]


# ---------------------------------------------------------------- a real Learner


def test_real_learner_update_trains_on_the_packed_batch():
    """A TorchLearner built from the config runs its learner connector on episodes; its loss is
    ``policy_loss(token_logprobs(model, packed))`` of the processor's own batch."""
    transformers = pytest.importorskip("transformers")
    from ray.rllib.core.learner.torch.torch_learner import TorchLearner

    from ray_xlong.trajectory.loss import policy_loss
    from ray_xlong.trajectory.model import token_logprobs

    def tiny_lm():
        torch.manual_seed(0)
        cfg = transformers.Qwen2Config(vocab_size=128, hidden_size=64, intermediate_size=64,
                                       num_hidden_layers=1, num_attention_heads=1,
                                       num_key_value_heads=1, head_dim=64,
                                       attn_implementation="sdpa")
        return transformers.Qwen2ForCausalLM(cfg)

    class TinyLM(TorchRLModule):
        def setup(self):
            self.lm = tiny_lm()

        def _forward(self, batch, **kwargs):
            return {}

    class TokenLearner(TorchLearner):
        def compute_loss_for_module(self, *, module_id, config, batch, fwd_out):
            packed = packed_from_batch(batch)
            return policy_loss(token_logprobs(self.module[module_id].lm, packed), packed)[0]

    config = learner_config().learners(learner_class=TokenLearner).rl_module(
        rl_module_spec=RLModuleSpec(module_class=TinyLM))
    learner = config.build_learner(
        spaces={DEFAULT_MODULE_ID: (RUN_OBSERVATION_SPACE, RUN_ACTION_SPACE)})
    before = [p.detach().clone() for p in learner.module[DEFAULT_MODULE_ID].parameters()]
    results = learner.update(episodes=[run_to_episode(r) for r in runs()], timesteps={})

    packed = TrajectoryProcessor().process(runs()).packed
    with torch.no_grad():
        want, _ = policy_loss(token_logprobs(tiny_lm(), packed), packed)
    got = MetricsLogger.peek_results(results)[DEFAULT_MODULE_ID]
    assert got["total_loss"] == pytest.approx(float(want), rel=1e-5)
    assert got["xlong/num_targets"] == packed.num_targets
    after = list(learner.module[DEFAULT_MODULE_ID].parameters())
    assert any(not torch.equal(a, b) for a, b in zip(before, after))
