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


async def join_a_running_request(engine, long_prompt, short_prompt):
    """A long request generates; a short one arrives. Returns (long, short, whether the long
    one was still generating when the short one was answered)."""
    long = asyncio.ensure_future(engine.generate(long_prompt, sampling=SamplingConfig(
        max_tokens=120, temperature=0)))
    while engine.num_running() == 0:
        await asyncio.sleep(0.001)
    short = await engine.generate(short_prompt, sampling=SamplingConfig(
        max_tokens=4, temperature=0, seed=3))
    long_still_running = not long.done()
    return await long, short, long_still_running


def assert_joined_like_alone(engine_factory, long_prompt, short_prompt, *, atol):
    """Continuous batching: the short request joins the running batch and is answered while
    the long one still generates; both get what they get alone."""
    async def go():
        engine = engine_factory()
        before = engine.stats().batches
        joined = await join_a_running_request(engine, long_prompt, short_prompt)
        batches = engine.stats().batches - before
        alone = [await engine.generate(p, sampling=SamplingConfig(
            max_tokens=n, temperature=0, seed=3)) for p, n in ((long_prompt, 120),
                                                               (short_prompt, 4))]
        return joined, alone, batches

    (long, short, long_still_running), alone, batches = asyncio.run(go())
    assert long_still_running and batches == 2              # two admissions, one batch
    assert long.output_ids.size == 120 and short.output_ids.size == 4
    for joined, single in zip((long, short), alone):
        np.testing.assert_array_equal(joined.output_ids, single.output_ids)
        np.testing.assert_allclose(joined.output_logprobs, single.output_logprobs, atol=atol)


def test_hf_requests_join_the_running_batch_and_leave_when_done(model_dir):
    assert_joined_like_alone(lambda: HFEngine(model_dir), np.arange(1, 6),
                             np.arange(20, 40), atol=1e-5)


def test_hf_joined_rows_keep_token_exact_logprobs(model_dir):
    """Rows of different lengths joining at different steps: each output's logprobs are the
    teacher-forced ones of its own prompt (padding and neighbours change nothing)."""
    async def go():
        engine = HFEngine(model_dir, seed=0)
        tasks = []
        for i, p in enumerate(prompts() * 2):
            tasks.append(asyncio.ensure_future(engine.generate(p, sampling=SamplingConfig(
                max_tokens=5 + 7 * i, seed=i))))
            await asyncio.sleep(0.004 * i)                  # arrivals spread over the steps
        return await asyncio.gather(*tasks), engine.stats()

    results, stats = asyncio.run(go())
    model = load_model(model_dir)
    assert stats.batches > 1                               # they did arrive at several steps
    for i, (p, r) in enumerate(zip(prompts() * 2, results)):
        assert r.output_ids.size == 5 + 7 * i
        np.testing.assert_allclose(r.output_logprobs,
                                   teacher_forced_logprobs(model, p, r.output_ids), atol=1e-5)


def test_a_cancelled_request_leaves_the_batch(model_dir):
    async def go():
        engine = HFEngine(model_dir)
        gone = asyncio.ensure_future(engine.generate(np.arange(1, 6), sampling=SamplingConfig(
            max_tokens=2000, temperature=0)))
        while engine.num_running() == 0:
            await asyncio.sleep(0.001)
        gone.cancel()
        ok = await engine.generate(np.arange(1, 6), sampling=SamplingConfig(max_tokens=3))
        return engine, ok

    engine, ok = asyncio.run(go())
    assert ok.output_ids.size == 3
    assert engine.num_running() == 0                       # the 2000-token row was dropped
    assert engine.stats().requests == 1                    # and never counted as answered


def test_a_failing_step_fails_every_live_request_and_the_engine_recovers(model_dir):
    class Flaky(HFEngine):
        def _step(self, new, drop):
            if any(ids[0] == 13 for _, ids, _, _ in new):
                raise RuntimeError("boom")
            return super()._step(new, drop)

    async def go():
        engine = Flaky(model_dir)
        running = asyncio.ensure_future(engine.generate(np.arange(1, 6), sampling=SamplingConfig(
            max_tokens=500)))
        while engine.num_running() == 0:
            await asyncio.sleep(0.001)
        bad = asyncio.ensure_future(engine.generate(np.array([13, 1]), sampling=SamplingConfig()))
        for request in (running, bad):
            with pytest.raises(EngineError, match="boom"):
                await request
        return engine, await engine.generate(np.arange(1, 6), sampling=SamplingConfig(
            max_tokens=3))

    engine, ok = asyncio.run(go())
    assert ok.output_ids.size == 3 and engine.num_running() == 0


@pytest.mark.parametrize("arch", ["mistral-sliding", "gemma3-sliding"])
def test_sliding_window_models_run_whole_batches_token_exact(arch):
    """A sliding-window cache cannot be left-padded and joined: whole batches, rows of
    different lengths leaving at different steps, logprobs still the teacher-forced ones."""
    from ray_xlong.models.architectures import build_arch

    model = build_arch(arch, seed=0)
    engine = HFEngine("unused", model=model)
    batch = [(np.arange(3, 20) % 90 + 3, 2), (np.arange(5, 9), 20), (np.arange(10, 13), 25)]

    async def go():
        return await asyncio.gather(*(engine.generate(p, sampling=SamplingConfig(
            max_tokens=n, seed=i)) for i, (p, n) in enumerate(batch)))

    assert not engine.joins_running_batch
    for (p, n), r in zip(batch, asyncio.run(go())):
        assert r.output_ids.size == n
        np.testing.assert_allclose(r.output_logprobs,
                                   teacher_forced_logprobs(model, p, r.output_ids), atol=1e-5)


def test_back_to_back_weight_updates_and_waiting_requests_all_complete(model_dir):
    """A second update (and requests) arriving while the first loads are not left waiting."""
    new = load_model(model_dir).state_dict()

    async def go():
        engine = HFEngine(model_dir)
        first = asyncio.ensure_future(engine.update_weights(new, version=1))
        await asyncio.sleep(0)
        second = asyncio.ensure_future(engine.update_weights(new, version=2))
        request = asyncio.ensure_future(engine.generate(np.arange(1, 6), sampling=SamplingConfig(
            max_tokens=3)))
        done, pending = await asyncio.wait([first, second, request], timeout=60)
        return engine, len(done), len(pending), request

    engine, done, pending, request = asyncio.run(go())
    assert (done, pending) == (3, 0) and engine.policy_version == 2
    assert request.result().policy_version == 2


def test_an_update_with_unknown_names_changes_nothing(model_dir):
    """Refused weights leave the model and its version as they were (one known name scaled,
    one unknown name: nothing loads)."""
    good = load_model(model_dir).state_dict()
    name = next(iter(good))
    bad = {name: good[name] * 3.0, "no.such.weight": torch.zeros(1)}

    async def go():
        engine = HFEngine(model_dir)
        before = await engine.generate(np.arange(1, 6), sampling=SamplingConfig(
            max_tokens=6, temperature=0))
        with pytest.raises(ValueError, match="unknown parameter names"):
            await engine.update_weights(bad, version=1)
        after = await engine.generate(np.arange(1, 6), sampling=SamplingConfig(
            max_tokens=6, temperature=0))
        return engine, before, after

    engine, before, after = asyncio.run(go())
    assert engine.policy_version == 0 and after.policy_version == 0
    torch.testing.assert_close(engine.model.state_dict()[name], good[name])
    np.testing.assert_array_equal(before.output_ids, after.output_ids)
    np.testing.assert_allclose(before.output_logprobs, after.output_logprobs, atol=1e-6)


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
        while engine.num_running() == 0:           # the long request is in flight
            await asyncio.sleep(0)
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
        while engine.num_pending() == 0:         # the request reached the queue …
            await asyncio.sleep(0)
        assert not waiting.done() and engine.num_pending() == 1     # … and waits there
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
