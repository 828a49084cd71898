"""Engine settings for long contexts (``rollout/engine_settings.py``), checked on CPU: the
``vllm.LLM`` arguments are built and checked without a GPU (vLLM's own ``EngineArgs`` parses
them where vLLM is installed); the length comes from the model, never a silent 4096."""

from __future__ import annotations

import json
import pickle

import pytest

from ray_xlong.rollout.engine_settings import (EngineSettings, eager, model_max_len,
                                               resolve_max_model_len)
from ray_xlong.rollout.vllm_engine import VLLMEngineMaker, engine_args, vllm_available


def model_dir(tmp_path, **conf):
    path = tmp_path / "model"
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({"model_type": "llama", **conf}))
    return path


@pytest.mark.parametrize("conf, want", [
    pytest.param({"max_position_embeddings": 131072}, 131072, id="llama-style"),
    pytest.param({"text_config": {"max_position_embeddings": 32768}}, 32768, id="multimodal"),
    pytest.param({"n_positions": 2048}, 2048, id="gpt2-style"),
    pytest.param({}, None, id="none-stated")])
def test_the_models_length_comes_from_its_config(tmp_path, conf, want):
    assert model_max_len(model_dir(tmp_path, **conf)) == want


def test_max_model_len_none_is_the_models_and_above_it_is_refused_naming_both(tmp_path):
    path = model_dir(tmp_path, max_position_embeddings=65536)
    assert resolve_max_model_len(path, None) == 65536
    assert resolve_max_model_len(path, 8192) == 8192
    with pytest.raises(ValueError, match=r"max_model_len=100000 .*max_position_embeddings=65536"):
        resolve_max_model_len(path, 100000)
    with pytest.raises(ValueError, match="VLLMEngine.max_model_len is None .*states no length"):
        resolve_max_model_len(model_dir(tmp_path / "x"), None, field="VLLMEngine.max_model_len")


@pytest.mark.parametrize("field, value", [
    ("max_model_len", 0), ("max_model_len", True), ("tensor_parallel_size", 0),
    ("tensor_parallel_size", 1.5), ("enforce_eager", "no"), ("enable_prefix_caching", None),
    ("gpu_memory_utilization", 0.0), ("gpu_memory_utilization", 1.5)])
def test_bad_settings_name_the_field(field, value):
    with pytest.raises(ValueError, match=f"EngineSettings.{field}"):
        EngineSettings(**{field: value})


def test_cuda_graphs_on_gpu_eager_on_cpu_or_where_asked():
    assert eager(None, cuda=True) is False and eager(None, cuda=False) is True
    assert eager(True, cuda=True) is True and eager(False, cuda=True) is False


def test_engine_args_for_a_long_context_tp2_gpu_engine(tmp_path):
    path = model_dir(tmp_path, max_position_embeddings=262144)
    args = engine_args(path, seed=0, dtype="bfloat16", max_model_len=None,
                       tensor_parallel_size=2, cuda=True, gpu_memory_utilization=0.8)
    assert args["max_model_len"] == 262144 and args["max_num_batched_tokens"] >= 262144
    assert args["enforce_eager"] is False and args["enable_prefix_caching"] is True
    assert args["tensor_parallel_size"] == 2 and args["distributed_executor_backend"] == "mp"
    cpu = engine_args(path, seed=0, dtype="float32", max_model_len=4096,
                      tensor_parallel_size=1, cuda=False, gpu_memory_utilization=0.4)
    assert cpu["enforce_eager"] is True and cpu["max_model_len"] == 4096
    asked = engine_args(path, seed=0, dtype="bfloat16", max_model_len=None,
                        tensor_parallel_size=1, cuda=True, gpu_memory_utilization=0.4,
                        enforce_eager=True, enable_prefix_caching=False)
    assert asked["enforce_eager"] is True and asked["enable_prefix_caching"] is False
    with pytest.raises(ValueError, match=r"VLLMEngine.max_model_len=300000 .*262144"):
        engine_args(path, seed=0, dtype="bfloat16", max_model_len=300000,
                    tensor_parallel_size=1, cuda=True, gpu_memory_utilization=0.4)
    if vllm_available():
        from vllm.engine.arg_utils import EngineArgs

        parsed = EngineArgs(**args)
        assert parsed.max_model_len == 262144 and parsed.enforce_eager is False
        assert parsed.tensor_parallel_size == 2 and parsed.enable_prefix_caching is True


def test_the_engine_maker_carries_the_settings_to_each_engine(tmp_path, monkeypatch):
    """``make(index, tp)`` (what a cell's engine actors call) hands the settings and the
    layout's TP to the engine (construction recorded: TP 2 needs two GPUs)."""
    from ray_xlong.rollout import vllm_engine

    path = str(model_dir(tmp_path, max_position_embeddings=131072))
    settings = EngineSettings(max_model_len=100000, enforce_eager=True,
                              gpu_memory_utilization=0.7)
    maker = pickle.loads(pickle.dumps(VLLMEngineMaker.from_settings(path, settings, seed=3)))
    made = []
    monkeypatch.setattr(vllm_engine, "VLLMEngine",
                        lambda model_dir, **kw: made.append(kw) or "engine")
    assert maker(2, 2) == "engine"
    kw = made[0]
    assert (kw["seed"], kw["tensor_parallel_size"], kw["max_model_len"]) == (5, 2, 100000)
    assert kw["enforce_eager"] is True and kw["gpu_memory_utilization"] == 0.7
    assert VLLMEngineMaker(path).max_model_len is None                  # the model's own
    with pytest.raises(ValueError, match=r"VLLMEngineMaker.max_model_len=200000 .*131072"):
        VLLMEngineMaker(path, max_model_len=200000)


def test_rollout_config_passes_the_engine_settings_through(tmp_path):
    from ray_xlong.rllib.env_runner import RolloutConfig, vllm_engine_kwargs

    settings = EngineSettings(max_model_len=32768, tensor_parallel_size=2)
    cfg = RolloutConfig(model_dir=str(tmp_path), backend="vllm", dtype="bfloat16",
                        engine_settings=settings)
    kw = vllm_engine_kwargs(cfg)
    assert (kw["max_model_len"], kw["tensor_parallel_size"]) == (32768, 2)
    assert kw["enforce_eager"] is None and kw["enable_prefix_caching"] is True
    assert vllm_engine_kwargs(RolloutConfig(model_dir=str(tmp_path), backend="vllm")
                              )["max_model_len"] is None              # the model's, not 4096
    with pytest.raises(ValueError, match="RolloutConfig.engine_settings.tensor_parallel_size"):
        RolloutConfig(model_dir=str(tmp_path), engine_settings=settings)       # hf backend
    with pytest.raises(ValueError, match="RolloutConfig.engine_settings"):
        RolloutConfig(model_dir=str(tmp_path), engine_settings={"max_model_len": 8})
