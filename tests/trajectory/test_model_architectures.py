"""Exact loss on many architectures: both layouts = the model's own forward on plain sequences.

Logits go through the model's own head and post-processing (soft-capping, logit scaling);
sliding windows count by depth in the tree layout; what ``xlong_tree`` cannot do is refused.
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


@pytest.mark.parametrize("name, variant", [
    pytest.param("mistral-sliding", "sliding-window attention", id="sliding"),
    pytest.param("gemma2-softcap-sliding", "sliding-window attention", id="softcap-sliding"),
    pytest.param("stablelm", "does not pass the tree plan", id="no-kwargs"),
])
def test_xlong_tree_refuses_what_it_cannot_do_exactly(name, variant, batches):
    tree, flat = batches
    model = build_arch(name, attn_implementation="xlong_tree")
    with pytest.raises(TreeLayoutUnsupported, match=f"{variant}.*per_trajectory"):
        token_logprobs(model, tree)
    token_logprobs(model, flat)                        # the way out works


def test_attention_logit_softcapping_is_refused_by_xlong_tree(batches):
    tree, _ = batches
    model = build_arch("gemma2-softcap-sliding", attn_implementation="xlong_tree")
    model.config.sliding_window, model.config.layer_types = None, ["full_attention"] * 2
    with pytest.raises(TreeLayoutUnsupported, match="soft-capping.*per_trajectory"):
        token_logprobs(model, tree)
