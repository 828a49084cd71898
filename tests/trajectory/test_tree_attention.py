"""Tree attention plan: segments, keys and work (exactness is in test_model_equivalence.py)."""

from __future__ import annotations

import pytest
import torch

from ray_xlong.trajectory import ProcessorConfig, TrajectoryProcessor
from ray_xlong.trajectory.model import tree_mask_bool
from ray_xlong.trajectory.synthetic import SyntheticConfig, synthetic_runs
from ray_xlong.trajectory.tree_attention import tree_plan

# The module docstring's example: sys u1 >a1 | >a2 t1 >b1 S >s1 >s2 | >x1
KV_END = torch.tensor([[10, 10, 10, 9, 9, 9, 9, 9, 9, 10, 11, 12]])
VALID = torch.tensor([[True] * 10 + [False, False]])


def test_segments_of_the_docstring_example():
    plan = tree_plan(KV_END, VALID)
    assert [(s.start, s.stop, s.keys.tolist()) for s in plan.rows[0]] == [
        (0, 3, [0, 1, 2]), (3, 9, [0, 1, 2, 3, 4, 5, 6, 7, 8]), (9, 10, [0, 1, 2, 9])]
    assert plan.valid_lengths == (10,)


@pytest.mark.parametrize("chunk", [1, 2, 4, 256])
def test_chunks_see_exactly_what_the_mask_allows(chunk):
    batch = TrajectoryProcessor(ProcessorConfig(pack="tree", row_tokens=200)).process(
        synthetic_runs(4, groups=2, runs_per_group=2, config=SyntheticConfig.small())).packed
    plan = tree_plan(batch.attention_mask, batch.valid, chunk=chunk)
    mask = tree_mask_bool(batch.attention_mask)[:, 0]
    for r, segments in enumerate(plan.rows):
        covered = []
        for s in segments:
            assert s.stop - s.start <= chunk
            for q in range(s.start, s.stop):
                seen = {int(k) for k in s.keys[:s.num_prefix + q - s.start + 1]}
                assert seen == set(torch.nonzero(mask[r, q]).flatten().tolist())
                covered.append(q)
        assert covered == list(range(plan.valid_lengths[r]))


def test_work_never_exceeds_per_trajectory_work():
    runs = synthetic_runs(5, groups=2, runs_per_group=3, config=SyntheticConfig.small())
    tree = TrajectoryProcessor(ProcessorConfig(pack="tree", row_tokens=None)).process(runs)
    flat = TrajectoryProcessor(ProcessorConfig(pack="per_trajectory")).process(runs)
    per_traj = sum(n * (n + 1) // 2 for n in flat.packed.valid.sum(dim=1).tolist())
    assert tree_plan(tree.packed.attention_mask, tree.packed.valid, chunk=1).work <= per_traj


def test_hand_written_backward_matches_autograd():
    """The custom backward (recompute + accumulate) equals plain autograd through the slices
    (taken when dropout > 0; a dropout of 1e-300 drops nothing)."""
    from types import SimpleNamespace

    from ray_xlong.trajectory.tree_attention import tree_attention_forward

    batch = TrajectoryProcessor(ProcessorConfig(pack="tree", row_tokens=200)).process(
        synthetic_runs(6, groups=2, runs_per_group=2, config=SyntheticConfig.small())).packed
    plan = tree_plan(batch.attention_mask, batch.valid, chunk=3)
    rows, length = batch.input_ids.shape
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(rows, h, length, 8, generator=gen, dtype=torch.float64,
                           requires_grad=True) for h in (4, 2, 2))
    weight = torch.randn(rows, length, 4, 8, generator=gen, dtype=torch.float64)
    results = []
    for dropout in (0.0, 1e-300):
        module = SimpleNamespace(training=True)
        out, _ = tree_attention_forward(module, q, k, v, None, dropout=dropout, scaling=0.3,
                                        tree_plan=plan)
        grads = torch.autograd.grad((out * weight).sum(), (q, k, v))
        results.append((out.detach(), grads))
    (out_a, grads_a), (out_b, grads_b) = results
    assert torch.allclose(out_a, out_b, rtol=0, atol=1e-12)
    for ga, gb in zip(grads_a, grads_b):
        assert torch.allclose(ga, gb, rtol=0, atol=1e-12)
