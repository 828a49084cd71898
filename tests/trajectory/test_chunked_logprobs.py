"""Chunked logprobs: the head over chunks of targets (forward and backward) equals the
unchunked path (the model's own forward on all targets) — its logit post-processing included."""

from __future__ import annotations

import pytest
import torch

from ray_xlong.models.architectures import build_arch
from ray_xlong.trajectory import ProcessorConfig, TrajectoryProcessor
from ray_xlong.trajectory.chunked_logprobs import (LogitPost, LogitPostUnsupported, chunk_rows,
                                                   chunked_logprobs)
from ray_xlong.trajectory.model import token_logprobs
from tests.trajectory.test_model_equivalence import runs


@pytest.fixture(scope="module")
def batch():
    return TrajectoryProcessor(ProcessorConfig(max_trajectories_per_run=3, pack="per_trajectory")
                               ).process(runs()).packed


def logprobs_and_grads(model, batch, **kwargs):
    model.zero_grad()
    logprobs = token_logprobs(model, batch, **kwargs)
    (logprobs * torch.linspace(-1, 1, logprobs.numel())).sum().backward()
    return logprobs.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                               if p.grad is not None}


@pytest.mark.parametrize("name, temperature", [
    pytest.param("llama", 1.0, id="llama"),
    pytest.param("llama", 0.7, id="llama-temperature"),
    pytest.param("gemma2-softcap-sliding", 1.0, id="gemma2-final-softcap"),
    pytest.param("cohere-logit-scale", 0.7, id="cohere-logit-scale"),
    pytest.param("granite-logits-scaling", 1.0, id="granite-logits-scaling"),
])
def test_chunked_equals_the_unchunked_path(name, temperature, batch):
    model = build_arch(name)
    want, want_g = logprobs_and_grads(model, batch, temperature=temperature, chunk_tokens=0)
    got, got_g = logprobs_and_grads(model, batch, temperature=temperature, chunk_tokens=7)
    assert batch.num_targets > 50 and batch.num_targets % 7      # a ragged last chunk
    assert torch.allclose(got, want, rtol=0, atol=1e-5)
    assert want_g.keys() == got_g.keys()
    for key, g in want_g.items():
        assert float((got_g[key] - g).abs().max()) <= 1e-5 * max(float(g.abs().max()), 1e-6), key


def test_float64_head_is_exact():
    torch.manual_seed(0)
    head = torch.nn.Linear(16, 300, bias=True, dtype=torch.float64)
    hidden = torch.randn(41, 16, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 300, (41,))
    post = LogitPost(scale=0.5, softcap=3.0)
    got = chunked_logprobs(hidden, head, targets, post=post, temperature=0.8, chunk_tokens=4)
    want = torch.log_softmax(post.apply(head(hidden)) / 0.8, -1).gather(
        -1, targets.unsqueeze(-1)).squeeze(-1)
    assert torch.allclose(got, want, atol=1e-12, rtol=0)
    grads = torch.autograd.grad(got.sum(), (hidden, head.weight, head.bias))
    wants = torch.autograd.grad(want.sum(), (hidden, head.weight, head.bias))
    for g, w in zip(grads, wants):
        assert torch.allclose(g, w, atol=1e-12, rtol=0)


def test_post_processing_the_config_does_not_name_is_refused(batch):
    model = build_arch("llama")
    model.get_output_embeddings().register_forward_hook(lambda m, args, out: out * 3.0 + 1.0)
    with pytest.raises(LogitPostUnsupported, match="LlamaForCausalLM: its logits are not"):
        token_logprobs(model, batch)
    assert token_logprobs(model, batch, chunk_tokens=0).numel() == batch.num_targets


def test_default_chunk_is_a_fixed_byte_budget():
    assert chunk_rows(151_936, None) == 256 * 2 ** 20 // (4 * 151_936)       # 441 targets
    assert chunk_rows(64, 5) == 5
