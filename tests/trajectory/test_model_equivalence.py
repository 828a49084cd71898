"""Invariant 4: tree-packed training = per-trajectory training (logprobs, loss, gradients).

A tiny random causal LM built locally. fp64 + sdpa (bool mask): ≤ 1e-9; fp32 + sdpa and fp32 +
eager (float additive mask): ≤ 1e-5 (HF's eager attention takes its softmax in float32 whatever the
model dtype, so eager is checked at float32 tolerance). Gradients of the full PPO loss (count-once
scales) are compared per parameter.
"""

from __future__ import annotations

import pytest
import torch

from ray_xlong.models import TinyModelConfig, tiny_causal_lm
from ray_xlong.trajectory import LossConfig, ProcessorConfig, TrajectoryProcessor, policy_loss
from ray_xlong.trajectory.model import token_logprobs
from ray_xlong.trajectory.synthetic import SyntheticConfig, synthetic_runs

VOCAB = 64


def runs():
    cfg = SyntheticConfig(num_calls=10, vocab_size=VOCAB, system_tokens=4, task_tokens=3,
                          tool_tokens_mean=3.0, output_tokens_mean=3.0, context_budget=45,
                          summary_tokens=3, num_subagents=1, subagent_calls=2, num_retries=2,
                          timeout_prob=0.3, failed_prob=0.0)
    return synthetic_runs(3, groups=2, runs_per_group=2, config=cfg)


def loss_and_grads(model, layout, k=3, row_tokens=128):
    batch = TrajectoryProcessor(ProcessorConfig(max_trajectories_per_run=k, pack=layout,
                                                row_tokens=row_tokens)).process(runs())
    model.zero_grad()
    logprobs = token_logprobs(model, batch.packed)
    loss, _ = policy_loss(logprobs, batch.packed, LossConfig())
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()
             if p.grad is not None}
    return batch, logprobs.detach(), loss.detach(), grads


@pytest.mark.parametrize("arch, dtype, impl, tol", [
    pytest.param("qwen2", torch.float64, "sdpa", 1e-9, id="qwen2-fp64-sdpa"),
    pytest.param("llama", torch.float64, "sdpa", 1e-9, id="llama-fp64-sdpa"),
    pytest.param("qwen2", torch.float32, "sdpa", 1e-5, id="qwen2-fp32-sdpa"),
    pytest.param("llama", torch.float32, "eager", 1e-5, id="llama-fp32-eager"),
    pytest.param("qwen2", torch.float64, "xlong_tree", 1e-9, id="qwen2-fp64-tree-attention"),
    pytest.param("llama", torch.float32, "xlong_tree", 1e-5, id="llama-fp32-tree-attention"),
])
def test_tree_and_per_trajectory_agree(arch, dtype, impl, tol):
    model = tiny_causal_lm(TinyModelConfig(arch=arch, vocab_size=VOCAB), seed=0, dtype=dtype,
                           attn_implementation=impl)
    tb, tree_lp, tree_loss, tree_g = loss_and_grads(model, "tree")
    fb, flat_lp, flat_loss, flat_g = loss_and_grads(model, "per_trajectory")
    assert tb.stats.trajectories_dropped > 0          # the cap is exercised
    assert tb.packed.num_targets == fb.packed.num_targets > 50
    assert tb.packed.num_positions < fb.packed.num_positions    # the tree computes less
    assert torch.allclose(tree_lp, flat_lp, rtol=0, atol=tol)
    assert abs(float(tree_loss - flat_loss)) <= tol * max(1.0, abs(float(flat_loss)))
    assert tree_g.keys() == flat_g.keys() and len(tree_g) > 10
    for name, g in tree_g.items():
        rel = (g - flat_g[name]).norm() / flat_g[name].norm().clamp_min(1e-30)
        assert rel <= tol, f"{name}: relative gradient difference {float(rel):.2e}"


def test_bool_mask_under_eager_is_never_built():
    """Eager attention adds the mask: the tree path must hand it a float mask."""
    from ray_xlong.trajectory.model import tree_mask
    kv_end = torch.tensor([[3, 2, 3]])
    mask = tree_mask(kv_end, attn_implementation="eager", dtype=torch.float64)
    assert mask.dtype == torch.float64
    # column 1 (a leaf) is visible to query 1 only; query 2 sees 0 and 2
    assert (mask[0, 0] == 0).tolist() == [[True, False, False], [True, True, False],
                                          [True, False, True]]


def test_tree_rows_hold_several_runs_block_diagonally():
    model = tiny_causal_lm(TinyModelConfig(vocab_size=VOCAB), dtype=torch.float64,
                           attn_implementation="sdpa")
    _, one_per_row, _, _ = loss_and_grads(model, "tree", row_tokens=None)
    _, packed, _, _ = loss_and_grads(model, "tree", row_tokens=10_000)
    assert torch.allclose(one_per_row, packed, rtol=0, atol=1e-9)


@pytest.mark.slow
def test_flex_attention_block_mask_forward_matches_dense():
    """The GPU path (flex_attention + tree BlockMask); its forward also runs on CPU (slowly:
    flex attention is compiled on first use)."""
    dense = tiny_causal_lm(TinyModelConfig(vocab_size=VOCAB), attn_implementation="sdpa")
    flex = tiny_causal_lm(TinyModelConfig(vocab_size=VOCAB), attn_implementation="flex_attention")
    packed = TrajectoryProcessor(ProcessorConfig(pack="tree", row_tokens=None)).process(
        runs()).packed
    with torch.no_grad():
        assert torch.allclose(token_logprobs(dense, packed), token_logprobs(flex, packed),
                              rtol=0, atol=1e-5)
