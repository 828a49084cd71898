"""The local RL loop: the learnable task's contract, one train step, weights reaching the engine,
and (slow) RL actually raising the reward on the lookup task."""

from __future__ import annotations

import asyncio
import dataclasses

import numpy as np
import pytest
import torch

from ray_xlong.models import load_model
from ray_xlong.rollout import HarnessConfig, HFEngine, Harness
from benchmarks.tools.local_rl import (LocalRLConfig, WarmStartConfig, push_weights, rollout,
                                        run_local_rl, train_step)
from ray_xlong.rollout.tasks import make_task
from ray_xlong.rollout.tasks.lookup import LookupTask, demonstration, noisy_demonstrations
from ray_xlong.trajectory import ProcessorConfig, TrajectoryProcessor
from ray_xlong.trajectory.packing import micro_batches


# -- the task -------------------------------------------------------------------------------
def test_lookup_rewards_right_value_partial_credit_and_wrong_key():
    task = make_task("lookup", seed=3)
    task.reset()
    assert task.score() == 0.0
    wrong = next(k for k in task.table if k != task.key)
    assert asyncio.run(task.call_tool("lookup", {"key": int(wrong)})) == task.table[wrong]
    task.submit(task.table[wrong])
    assert task.score() == 0.0                         # a wrong key's value earns nothing
    assert asyncio.run(task.call_tool("lookup", {"key": int(task.key)})) == task.value
    assert task.score() == 0.2                         # right key looked up, wrong answer
    task.submit(task.value)
    assert task.score() == 1.0


def test_lookup_value_is_only_reachable_through_the_tool():
    task = LookupTask(5)
    obs = task.reset()
    assert task.key in obs.prompt and task.value not in obs.prompt + obs.system
    assert len(set(LookupTask(s).value for s in range(50))) > 20      # values vary by seed


@pytest.mark.parametrize("args", [{}, {"key": "x"}, {"key": 10}, {"key": "1 2"}])
def test_lookup_bad_key_is_a_tool_error(args):
    from ray_xlong.rollout.tasks import ToolError

    with pytest.raises(ToolError, match="no key"):
        asyncio.run(LookupTask(0).call_tool("lookup", args))


def test_noisy_demonstrations_look_up_the_right_key_at_the_rate(chat):
    demos = noisy_demonstrations(chat, count=400, right_key_rate=0.25, seed=0)
    right = 0
    for ids, mask in demos:
        text = chat.decode(ids)
        key = text.split("value of key ")[1].split("?")[0]
        call = chat.decode(ids[mask]).split("<|end|>")[0]
        right += call == f"<|call|>lookup {key}"
    assert 0.18 < right / len(demos) < 0.32             # 0.25 ± ~3.5 std of a binomial(400)


def test_demonstration_masks_the_model_turns(chat):
    ids, mask = demonstration(LookupTask(0), chat)
    assert chat.decode(ids[mask]).startswith("<|call|>lookup")
    assert chat.decode(ids[mask]).endswith(f"<|answer|>{LookupTask(0).value}<|end|>")


# -- the pieces of the loop -----------------------------------------------------------------
def real_runs(model_dir, chat, *, groups=2, runs=4):
    engine = HFEngine(model_dir, max_batch_size=16, seed=0)
    harness = Harness(engine, chat, config=HarnessConfig(max_new_tokens=6, max_calls=2))
    return asyncio.run(rollout(harness, "lookup", task_seeds=list(range(groups)),
                               runs_per_group=runs, tag="t"))


def rewarded(runs):
    """The same runs with rewards spread within each group (a random model scores 0)."""
    return [dataclasses.replace(r, reward=float(i % 2)) for i, r in enumerate(runs)]


def test_rollout_runs_groups_of_real_runs(model_dir, chat):
    runs = real_runs(model_dir, chat)
    assert len(runs) == 8 and len({r.group_id for r in runs}) == 2
    assert all(r.calls and r.status in ("finished", "timeout") for r in runs)


@pytest.mark.parametrize("pack", ["tree", "per_trajectory"])
def test_train_step_lowers_the_loss_on_a_fixed_batch(model_dir, chat, pack):
    batch = TrajectoryProcessor(ProcessorConfig(pack=pack, row_tokens=96)).process(
        rewarded(real_runs(model_dir, chat))).packed
    if pack == "tree":
        from ray_xlong.trajectory.tree_attention import register

        register()
    model = load_model(model_dir, attn_implementation="xlong_tree" if pack == "tree" else "sdpa")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    micros = micro_batches(batch, max_tokens=64)
    first = train_step(model, opt, micros)
    for _ in range(4):
        last = train_step(model, opt, micros)
    assert first.targets == int(batch.target_ids.numel()) and first.micro_batches > 1
    assert abs(first.ratio_mean - 1.0) < 1e-3          # on-policy: engine and learner agree
    assert last.loss < first.loss - 1e-3


def test_push_weights_reach_the_engine_with_the_new_version(model_dir):
    engine = HFEngine(model_dir, max_batch_size=4, seed=0)
    learner = load_model(model_dir)
    with torch.no_grad():
        for p in learner.parameters():
            p.add_(0.01)

    async def go():
        await push_weights(learner, engine, version=1)
        from ray_xlong.rollout import SamplingConfig

        result = await engine.generate(np.array([1, 3, 20, 21]),
                                       sampling=SamplingConfig(max_tokens=2))
        return result.policy_version

    assert asyncio.run(go()) == 1 and engine.policy_version == 1
    for name, tensor in learner.state_dict().items():
        assert torch.equal(engine.model.state_dict()[name], tensor), name


def test_configs_name_the_bad_field():
    with pytest.raises(ValueError, match="LocalRLConfig.groups"):
        LocalRLConfig(groups=0)
    with pytest.raises(ValueError, match="LocalRLConfig.pack"):
        LocalRLConfig(pack="none")
    with pytest.raises(ValueError, match="WarmStartConfig.right_key_rate"):
        WarmStartConfig(right_key_rate=1.5)


# -- learning (slow) ------------------------------------------------------------------------
@pytest.mark.slow
def test_rl_raises_the_reward_on_the_lookup_task(tmp_path):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # deterministic and quiet on a 2-core machine; restored below
    try:
        config = LocalRLConfig(seed=1, steps=25)
        result = run_local_rl(config, tmp_path)
    finally:
        torch.set_num_threads(threads)
    assert result.initial_reward < 0.5                  # headroom: the warm start is weak
    assert result.rise >= 0.3, (result.initial_reward, result.rewards, result.final_reward)
