"""A model that leaves (``XLongAlgorithm.export_hf``, ``models/export.py``): the tiny policy
trained 2 steps (the shared ``trained_algo``), exported by its Learner, loads in transformers
with the Learner's weights bit for bit and the same logits, carries the policy directory's
tokenizer and generation config, and is what ``ray-xlong export`` writes from the
``save_to_path`` checkpoint of the same version; the vLLM engine serves it."""

from __future__ import annotations

import json
import os
import pathlib

import pytest
import torch

pytestmark = pytest.mark.slow


def _logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits


def test_export_loads_in_transformers_with_the_learners_weights(trained_algo):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ray_xlong.models import load_model

    out = pathlib.Path(trained_algo.exported)
    names = {p.name for p in out.iterdir()}
    assert {"model.safetensors", "config.json", "generation_config.json", "tokenizer.json",
            "tokenizer_config.json"} <= names
    src = {p.name for p in pathlib.Path(trained_algo.model_dir).iterdir()}
    assert src - {"model.safetensors"} <= names          # every tokenizer / chat file kept
    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    got = model.state_dict()
    weights = trained_algo.weights
    assert weights.keys() == got.keys()
    assert all(torch.equal(weights[k], got[k]) for k in weights)   # bit for bit
    learner = load_model(trained_algo.model_dir)
    learner.load_state_dict(weights)
    ids = list(range(5, 40))
    torch.testing.assert_close(_logits(model, ids), _logits(learner, ids), rtol=0, atol=1e-6)
    mine, theirs = (AutoTokenizer.from_pretrained(str(p)) for p in (out, trained_algo.model_dir))
    text = "tool call: lookup(3) -> 7"
    assert mine(text)["input_ids"] == theirs(text)["input_ids"]
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "float32"


def test_cli_export_of_the_checkpoint_equals_the_learners_export(trained_algo, tmp_path):
    """``ray-xlong export CHECKPOINT OUT`` reads the save_to_path checkpoint (DCP) in a plain
    process, file by file: the same tensors as the Learner's own export."""
    from safetensors.torch import load_file

    from ray_xlong.cli import main

    out = tmp_path / "hf"
    assert main(["export", str(trained_algo.checkpoint), str(out)]) == 0
    a = load_file(str(out / "model.safetensors"))
    b = load_file(str(pathlib.Path(trained_algo.exported) / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.vllm
def test_the_vllm_engine_serves_the_export(trained_algo, tmp_path):
    from ray_xlong.rollout.vllm_engine import vllm_available

    if not vllm_available():
        pytest.skip("vllm is not installed")
    import asyncio

    import numpy as np

    from ray_xlong.rollout import HFEngine, SamplingConfig
    from ray_xlong.rollout.vllm_engine import VLLMEngine

    os.environ.setdefault("VLLM_CACHE_ROOT", str(tmp_path / "vllm_cache"))
    out = str(trained_algo.exported)
    prompt = np.arange(20, 60) % 300 + 12

    async def go(engine):
        return await engine.generate(prompt, sampling=SamplingConfig(max_tokens=8,
                                                                     temperature=0))

    v = asyncio.run(go(VLLMEngine(out, seed=0, max_model_len=512)))
    h = asyncio.run(go(HFEngine(out)))
    np.testing.assert_array_equal(v.output_ids, h.output_ids)
    np.testing.assert_allclose(v.output_logprobs, h.output_logprobs, atol=1e-4)
