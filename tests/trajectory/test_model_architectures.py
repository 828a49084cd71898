"""Exact loss on many architectures: both layouts = the model's own forward on plain sequences.

Logits go through the model's own head and post-processing (soft-capping, logit scaling);
sliding windows count by depth in the tree layout, with the dense mask and with ``xlong_tree``
alike (per layer type; soft-capped attention too); what ``xlong_tree`` cannot do is refused.
"""

from __future__ import annotations

import pytest
import torch

from ray_xlong.models.architectures import ARCHS, build_arch
from ray_xlong.trajectory.model import TreeLayoutUnsupported, token_logprobs
from tests.trajectory.test_model_equivalence import runs

TOL = 2e-4


def packed(layout):
    from ray_xlong.trajectory import ProcessorConfig, TrajectoryProcessor

    return TrajectoryProcessor(ProcessorConfig(max_trajectories_per_run=3,
                                               pack=layout)).process(runs()).packed


def plain_reference(model, flat):
    """Each trajectory (a per-trajectory row) as one plain sequence, read at its targets."""
    out = torch.empty(flat.num_targets)
    for r in range(flat.input_ids.shape[0]):
        n = int(flat.attention_mask[r].sum())
        logp = torch.log_softmax(model(input_ids=flat.input_ids[r:r + 1, :n]).logits[0], -1)
        sel = (flat.target_row == r).nonzero().flatten()
        out[sel] = logp[flat.target_src[sel], flat.target_ids[sel]]
    return out


@pytest.fixture(scope="module")
def batches():
    return packed("tree"), packed("per_trajectory")


CORE = ("llama", "gemma2-softcap-sliding", "cohere-logit-scale", "granite-logits-scaling",
        "mistral-sliding")


@pytest.mark.parametrize("name", [pytest.param(n, marks=() if n in CORE else pytest.mark.slow)
                                  for n in sorted(ARCHS)])
def test_both_layouts_equal_the_models_own_forward(name, batches):
    tree, flat = batches
    model = build_arch(name, attn_implementation=ARCHS[name][2])
    with torch.no_grad():
        ref = plain_reference(model, flat)
        assert (token_logprobs(model, tree) - ref).abs().max() <= TOL
        assert (token_logprobs(model, flat) - ref).abs().max() <= TOL


@pytest.mark.parametrize("name", ["gemma2-softcap-sliding", "cohere-logit-scale",
                                  "mistral-sliding"])
def test_tree_gradients_equal_plain_sequence_gradients(name, batches):
    tree, flat = batches
    model = build_arch(name, attn_implementation=ARCHS[name][2])
    w = torch.linspace(0.5, 1.5, tree.num_targets)

    def grads(fn):
        model.zero_grad()
        (fn() * w).sum().backward()
        return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])

    g_tree = grads(lambda: token_logprobs(model, tree))
    g_ref = grads(lambda: plain_reference(model, flat))
    assert (g_tree - g_ref).abs().max() <= TOL * g_ref.abs().max()


def test_the_depth_window_and_the_logit_post_processing_matter(batches):
    """Without them the numbers differ: the checks above can fail."""
    tree, flat = batches
    model = build_arch("mistral-sliding")
    with torch.no_grad():
        ref = plain_reference(model, flat)
        model.config.sliding_window = None             # a tree mask without the window
        assert (token_logprobs(model, tree) - ref).abs().max() > 1e-3
    model = build_arch("cohere-logit-scale")
    with torch.no_grad():
        head_only = model.get_output_embeddings()(model.get_decoder()(
            input_ids=flat.input_ids[:1]).last_hidden_state)
        assert (head_only - model(input_ids=flat.input_ids[:1]).logits).abs().max() > 1e-2


def test_xlong_tree_refuses_what_it_cannot_do_exactly(batches):
    tree, flat = batches
    model = build_arch("stablelm", attn_implementation="xlong_tree")
    with pytest.raises(TreeLayoutUnsupported, match="does not pass the tree plan.*per_trajectory"):
        token_logprobs(model, tree)
    token_logprobs(model, flat)                        # the way out works


SLIDING = ("mistral-sliding", "gemma2-softcap-sliding", "gemma3-sliding", "qwen2-sliding")


def _xlong_and_dense(name, *, window=None):
    dense = build_arch(name, attn_implementation=ARCHS[name][2])
    fast = build_arch(name, attn_implementation="xlong_tree")
    if window is not None:
        dense.config.sliding_window = fast.config.sliding_window = window
    return fast, dense


@pytest.mark.parametrize("name,window", [("mistral-sliding", 16)] + [(n, None) for n in SLIDING])
def test_xlong_tree_sliding_windows_equal_the_dense_tree_mask(name, window, batches):
    tree, flat = batches
    assert int(tree.position_ids.max()) > 2 * (window or ARCHS[name][1]["sliding_window"])
    fast, dense = _xlong_and_dense(name, window=window)
    with torch.no_grad():
        x = token_logprobs(fast, tree)
        assert (x - token_logprobs(dense, tree)).abs().max() <= TOL
        assert (x - plain_reference(dense, flat)).abs().max() <= TOL


@pytest.mark.parametrize("name", ["mistral-sliding",
                                  pytest.param("gemma2-softcap-sliding", marks=pytest.mark.slow)])
def test_xlong_tree_window_gradients_equal_plain_sequence_gradients(name, batches):
    tree, flat = batches
    fast, dense = _xlong_and_dense(name)
    fast.load_state_dict(dense.state_dict())
    w = torch.linspace(0.5, 1.5, tree.num_targets)

    def grads(model, fn):
        model.zero_grad()
        (fn() * w).sum().backward()
        return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])

    g_tree = grads(fast, lambda: token_logprobs(fast, tree))
    g_ref = grads(dense, lambda: plain_reference(dense, flat))
    assert (g_tree - g_ref).abs().max() <= TOL * g_ref.abs().max()


def test_xlong_tree_window_and_softcap_matter(batches):
    """Without the window (or the soft-cap) the numbers differ: the checks above can fail."""
    tree, flat = batches
    fast, dense = _xlong_and_dense("mistral-sliding")
    with torch.no_grad():
        ref = plain_reference(dense, flat)
        fast.config.sliding_window = None
        assert (token_logprobs(fast, tree) - ref).abs().max() > 1e-3
    fast, dense = _xlong_and_dense("gemma2-softcap-sliding")
    for model in (fast, dense):                    # a cap that binds on tiny random scores
        for layer in model.model.layers:
            layer.self_attn.attn_logit_softcapping = 0.05
    with torch.no_grad():
        ref = plain_reference(dense, flat)
        assert (token_logprobs(fast, tree) - ref).abs().max() <= TOL
        for layer in fast.model.layers:
            layer.self_attn.attn_logit_softcapping = None
        assert (token_logprobs(fast, tree) - ref).abs().max() > 1e-3
