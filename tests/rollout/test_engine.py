"""Engines: token-exact outputs (checked by teacher forcing), batching, weights between batches,
sleep / wake, bad input. HF backend and the scripted engine (fast); vLLM in test_vllm_engine.py."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from ray_xlong.models import load_model
from ray_xlong.rollout import EngineError, HFEngine, SamplingConfig, ScriptedEngine


def teacher_forced_logprobs(model, inp, out):
    full = torch.from_numpy(np.concatenate([inp, out]))[None]
    with torch.no_grad():
        logits = model(input_ids=full).logits[0, inp.size - 1:-1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.from_numpy(out)[:, None])[:, 0].numpy()


def prompts():
    return [np.arange(1, 6), np.arange(20, 40), np.array([7, 300, 301, 302])]


def test_hf_outputs_are_token_exact_and_batching_changes_nothing(model_dir):
    async def go():
        engine = HFEngine(model_dir, seed=0)
        sampling = [SamplingConfig(max_tokens=6, seed=i) for i in range(3)]
        batched = await asyncio.gather(*(engine.generate(p, sampling=s)
                                         for p, s in zip(prompts(), sampling)))
        single = [await engine.generate(p, sampling=s) for p, s in zip(prompts(), sampling)]
        return engine, batched, single

    engine, batched, single = asyncio.run(go())
    model = load_model(model_dir)
    assert engine.stats().batches == 4            # 3 concurrent requests → 1 batch, then 3
    for p, b, s in zip(prompts(), batched, single):
        np.testing.assert_array_equal(b.output_ids, s.output_ids)
        assert b.output_ids.size == 6 and b.finish_reason == "length"
        np.testing.assert_allclose(b.output_logprobs,
                                   teacher_forced_logprobs(model, p, b.output_ids), atol=1e-5)


def test_stop_token_ends_generation_and_is_kept(model_dir):
    async def go():
        engine = HFEngine(model_dir)
        first = await engine.generate(np.arange(1, 6), sampling=SamplingConfig(
            max_tokens=8, temperature=0))
        stop = int(first.output_ids[2])
        return first, await engine.generate(np.arange(1, 6), sampling=SamplingConfig(
            max_tokens=8, temperature=0, stop_token_ids=(stop,))), stop

    first, stopped, stop = asyncio.run(go())
    cut = int(np.flatnonzero(first.output_ids == stop)[0]) + 1
    np.testing.assert_array_equal(stopped.output_ids, first.output_ids[:cut])
    assert stopped.finish_reason == "stop"


def test_weight_update_waits_for_the_request_in_flight(model_dir):
    new = {k: v + 0.01 for k, v in load_model(model_dir).state_dict().items()}

    async def go():
        engine = HFEngine(model_dir)
        long = asyncio.ensure_future(engine.generate(np.arange(1, 6), sampling=SamplingConfig(
            max_tokens=40, temperature=0)))
        await asyncio.sleep(0.05)                  # the long request is in flight
        await engine.update_weights(new, version=1)
        after = await engine.generate(np.arange(1, 6), sampling=SamplingConfig(
            max_tokens=40, temperature=0))
        return await long, after, engine

    before, after, engine = asyncio.run(go())
    assert before.policy_version == 0 and after.policy_version == 1
    assert before.output_ids.size == 40
    model = load_model(model_dir)
    np.testing.assert_allclose(before.output_logprobs, teacher_forced_logprobs(
        model, np.arange(1, 6), before.output_ids), atol=1e-5)
    model.load_state_dict(new)
    np.testing.assert_allclose(after.output_logprobs, teacher_forced_logprobs(
        model, np.arange(1, 6), after.output_ids), atol=1e-5)
    assert engine.stats().weight_updates == 1


def test_sleep_queues_requests_until_wake_and_keeps_weights(model_dir):
    new = {k: v * 1.01 for k, v in load_model(model_dir).state_dict().items()}

    async def go():
        engine = HFEngine(model_dir)
        await engine.update_weights(new, version=3)
        ref = await engine.generate(np.arange(1, 6), sampling=SamplingConfig(
            max_tokens=5, temperature=0))
        await engine.sleep()
        assert engine.is_sleeping and engine.model is None
        waiting = asyncio.ensure_future(engine.generate(np.arange(1, 6), sampling=SamplingConfig(
            max_tokens=5, temperature=0)))
        await asyncio.sleep(0.05)
        assert not waiting.done() and engine.num_pending() == 1
        await engine.wake_up()
        return ref, await waiting

    ref, woke = asyncio.run(go())
    np.testing.assert_array_equal(ref.output_ids, woke.output_ids)
    assert woke.policy_version == 3


@pytest.mark.parametrize("bad", [
    pytest.param(np.array([], np.int64), id="empty"),
    pytest.param(np.array([[1, 2]]), id="2d"),
    pytest.param(np.array([1.5, 2.0]), id="floats"),
    pytest.param(np.array([1, 10**6]), id="out-of-vocab"),
    pytest.param(np.array([-1, 2]), id="negative"),
])
def test_bad_input_ids_raise(model_dir, bad):
    with pytest.raises(ValueError, match="input_ids"):
        asyncio.run(HFEngine(model_dir).generate(bad, sampling=SamplingConfig()))


@pytest.mark.parametrize("field,kwargs", [
    ("max_tokens", dict(max_tokens=0)), ("temperature", dict(temperature=-1.0)),
    ("stop_token_ids", dict(stop_token_ids=(-3,))),
])
def test_sampling_config_errors_name_the_field(field, kwargs):
    with pytest.raises(ValueError, match=field):
        SamplingConfig(**kwargs)


def test_a_failing_batch_fails_its_requests_and_the_engine_keeps_serving():
    def policy(ids):
        if ids[0] == 13:
            raise RuntimeError("boom")
        return np.array([5, 6, 9])

    async def go():
        engine = ScriptedEngine(policy, vocab_size=64)
        with pytest.raises(EngineError, match="boom"):
            await engine.generate(np.array([13, 1]), sampling=SamplingConfig(max_tokens=4))
        ok = await engine.generate(np.array([1, 2]), sampling=SamplingConfig(
            max_tokens=4, stop_token_ids=(6,)))
        await engine.close()
        with pytest.raises(EngineError, match="closed"):
            await engine.generate(np.array([1, 2]), sampling=SamplingConfig())
        return ok

    ok = asyncio.run(go())
    np.testing.assert_array_equal(ok.output_ids, [5, 6])
    assert ok.finish_reason == "stop"
