"""The harness with scripted policies (known branching) and a real HF engine.

Scripted runs go through a ``ScriptedEngine`` whose logprobs come from the real tiny model; the
branching of each run is fixed by its policy, so the trajectories the processor assembles are
known. Token exactness is checked against what the engine itself received and produced.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from ray_xlong.models import load_model
from ray_xlong.rollout import HFEngine, Harness, HarnessConfig, ScriptedEngine
from ray_xlong.rollout.tasks import ArithmeticTask, LongHorizonConfig, LongHorizonTask
from ray_xlong.rollout.tasks.long_horizon import oracle_policy
from ray_xlong.trajectory import ProcessorConfig, TrajectoryProcessor, assemble


class Spy:
    """Wraps a policy; keeps (input copy, output) of every request the engine served."""

    def __init__(self, policy):
        self.policy, self.seen = policy, []

    def __call__(self, ids):
        out = np.asarray(self.policy(ids), np.int64)
        self.seen.append((np.array(ids), out))
        return out


def branching_policy(chat, task):
    """main: malformed (retried) → add → subagent → [compaction] → answer; sub: add → answer."""
    visits = {}

    def policy(ids):
        text = chat.decode(ids)
        key = (ids.size, hash(ids.tobytes()))
        visits[key] = visits.get(key, 0) + 1
        if int(ids[-1]) == chat.summarize:
            return np.concatenate([chat.encode(f"sum {task.a + task.b}"), [chat.end]])
        if "Subtask" in text:
            if text.count("<|tool|>") == 0:
                return chat.call_ids("add", f"{task.a} {task.b}")
            return chat.answer_ids(" ".join([f"the sum is {task.a + task.b}"] * 6))
        if "<|summary|>" in text:
            return chat.answer_ids(str(task.a + task.b))
        if text.count("<|tool|>") == 0:
            return chat.encode("oops") if visits[key] == 1 else chat.call_ids(
                "add", f"{task.a} {task.b}")
        return chat.call_ids("subagent", "add the two numbers")
    return policy


CONFIG = HarnessConfig(max_new_tokens=48, compaction_budget=60, context_capacity=400,
                       max_retries=1, max_calls=12)


@pytest.fixture(scope="module")
def scripted_run(model_dir, chat):
    task = ArithmeticTask(5)
    spy = Spy(branching_policy(chat, task))
    engine = ScriptedEngine(spy, vocab_size=512, model=load_model(model_dir))
    result = asyncio.run(Harness(engine, chat, config=CONFIG).run(task, run_id="r", group_id="g"))
    return result, spy


def test_scripted_run_branches_as_scripted(scripted_run):
    result, _ = scripted_run
    run, info = result.run, result.info
    assert run.status == "finished" and run.reward == 1.0
    assert [(c.agent_id, c.kind) for c in run.calls] == [
        ("main", "main"), ("main", "main"), ("main", "main"),     # malformed, add, subagent
        ("sub1", "subagent"), ("sub1", "subagent"),              # add, answer
        ("main", "summary"), ("main", "main")]                   # compaction, answer
    assert run.calls[3].parent_agent_id == "main"
    assert (info.retries, info.subagents, info.compactions) == (1, 1, 1)


def test_processor_assembles_the_expected_trajectories(scripted_run):
    run = scripted_run[0].run
    trajs = assemble(run)
    assert sorted((t.agent_id, t.kind, t.origin, t.call_indices) for t in trajs) == sorted([
        ("main", "main", "start", (0,)),            # the malformed output, alone
        ("main", "main", "retry", (1, 2)),          # the retry from the same context
        ("sub1", "subagent", "start", (3, 4)),
        ("main", "summary", "start", (5,)),
        ("main", "main", "compaction", (6,)),       # continues from prompt + summary
    ])
    batch = TrajectoryProcessor(ProcessorConfig(pack="tree")).process([run])
    assert batch.stats.trajectories_kept == 5
    assert batch.stats.trainable_tokens == run.num_tokens


def test_every_call_is_exactly_what_the_engine_saw(scripted_run):
    run, spy = scripted_run[0].run, scripted_run[1]
    assert len(spy.seen) == len(run.calls)
    for call, (inp, out) in zip(run.calls, spy.seen):
        np.testing.assert_array_equal(call.input_ids, inp)
        np.testing.assert_array_equal(call.output_ids, out)
        assert call.output_logprobs.max() < 0


def test_hf_engine_runs_are_token_exact(model_dir, chat):
    seen = []

    class SpyHF(HFEngine):
        prompts = {}

        def _step(self, new, drop):
            self.prompts.update((key, np.array(ids)) for key, ids, _, _ in new)
            finished = super()._step(new, drop)
            seen.extend((self.prompts[key], o[0], o[1]) for key, o in finished)
            return finished

    engine = SpyHF(model_dir, seed=1)
    harness = Harness(engine, chat, config=HarnessConfig(max_new_tokens=12, max_calls=4))
    results = asyncio.run(harness.run_many([ArithmeticTask(i) for i in range(3)],
                                           run_ids=["a", "b", "c"], group_ids=["g"] * 3))
    calls = [c for r in results for c in r.run.calls]
    assert len(calls) == len(seen) and all(r.run.status == "timeout" for r in results)
    for call in calls:
        match = [s for s in seen if np.array_equal(s[0], call.input_ids)
                 and np.array_equal(s[1], call.output_ids)]
        assert match, call
        np.testing.assert_array_equal(match[0][2], call.output_logprobs)


def test_long_horizon_runs_compact_and_delegate(chat):
    engine = ScriptedEngine(oracle_policy(chat, num_steps=8), vocab_size=512)
    harness = Harness(engine, chat, config=HarnessConfig(
        max_new_tokens=32, compaction_budget=120, context_capacity=500, max_calls=40))
    envs = [LongHorizonTask(i, config=LongHorizonConfig(time_scale=1e-5)) for i in range(4)]
    results = asyncio.run(harness.run_many(envs, run_ids=list("abcd"), group_ids=["g"] * 4))
    for r in results:
        assert r.run.status == "finished" and r.run.reward == 1.0
        assert r.info.compactions >= 1 and r.info.subagents == 2
    assert any(e.tool_seconds > 0 for e in envs)
    TrajectoryProcessor(ProcessorConfig()).process([r.run for r in results])


def test_weight_update_mid_run_changes_versions_and_nothing_errors(model_dir, chat):
    model = load_model(model_dir)
    new = {k: v + 0.01 for k, v in model.state_dict().items()}
    task = SlowAdd(2)
    engine = ScriptedEngine(oracle_like(chat, task), vocab_size=512, model=model)

    async def go():
        harness = Harness(engine, chat, config=HarnessConfig(max_new_tokens=16))
        run = asyncio.ensure_future(harness.run(task, run_id="r", group_id="g"))
        while not engine.stats().requests:
            await asyncio.sleep(0.001)
        await engine.update_weights(new, version=1)
        return await run

    result = asyncio.run(go())
    versions = [c.policy_version for c in result.run.calls]
    assert result.run.status == "finished" and versions == [0, 1]


class SlowAdd(ArithmeticTask):
    """The add tool takes 0.3 s: the weight update lands while the run waits on it."""

    async def call_tool(self, name, args):
        await asyncio.sleep(0.3)
        return await super().call_tool(name, args)


def oracle_like(chat, task):
    return lambda ids: (chat.call_ids("add", f"{task.a} {task.b}")
                        if chat.decode(ids).count("<|tool|>") == 0
                        else chat.answer_ids(str(task.a + task.b)))
