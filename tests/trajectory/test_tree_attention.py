"""Tree attention plan: segments, keys and work (exactness is in test_model_equivalence.py)."""

from __future__ import annotations

import copy

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



# --- split-KV plans (split_kv.py): the fused-kernel path of every device, no masks -----------

def _tree_batch():
    from tests.trajectory.test_model_equivalence import runs

    return TrajectoryProcessor(ProcessorConfig(max_trajectories_per_run=3, pack="tree",
                                               row_tokens=128)).process(runs()).packed


def test_pieces_see_exactly_what_the_mask_allows():
    from ray_xlong.trajectory.split_kv import split_kv_plan, tree_pieces

    batch = _tree_batch()
    mask = tree_mask_bool(batch.attention_mask)[:, 0]
    plan = split_kv_plan(batch.attention_mask, batch.valid)
    ends = batch.attention_mask.numpy()
    for r, n in enumerate(batch.valid.sum(dim=1).tolist()):
        cut = tree_pieces(ends[r, :n], row=r, lo=n // 3, hi=2 * n // 3)   # a rank's range
        assert [p.start for p in cut][0] == n // 3 and cut[-1].stop == 2 * n // 3
        for p in [p for p in plan.pieces if p.row == r] + list(cut):
            for q in range(p.start, p.stop):
                seen = {c for lo, hi in p.prefix for c in range(lo, hi)} | set(range(p.start, q + 1))
                assert seen == set(torch.nonzero(mask[r, q]).flatten().tolist())


@pytest.mark.parametrize("kernel, dtype, tol", [
    pytest.param("math", torch.float64, 1e-10, id="math-fp64"),
    pytest.param("math", torch.float32, 2e-5, id="math-fp32"),
    pytest.param("cpu_flash", torch.float32, 2e-5, id="cpu-flash-fp32"),
    pytest.param("math", torch.bfloat16, 3e-2, id="math-bf16"),
])
def test_split_kv_plan_matches_the_segment_path(kernel, dtype, tol):
    """The device-generic split-KV driver, forced on CPU (``kernel='math'`` is what a device
    without a fused kernel runs; the CUDA kernels plug into the same driver)."""
    from ray_xlong.models import TinyModelConfig, tiny_causal_lm
    from ray_xlong.trajectory.model import attention_inputs
    from ray_xlong.trajectory.split_kv import split_kv_plan

    batch = _tree_batch()
    reference = tiny_causal_lm(TinyModelConfig(vocab_size=64, num_heads=2, num_kv_heads=1),
                               dtype=torch.float64, attn_implementation="xlong_tree")
    model = copy.deepcopy(reference).to(dtype)
    results = []
    for m, plan in ((model, split_kv_plan(batch.attention_mask, batch.valid, kernel=kernel)),
                    (reference, None)):
        inputs = attention_inputs(m, batch)
        if plan is not None:
            inputs["tree_plan"] = plan
        logits = m(**inputs, use_cache=False).logits
        loss = (logits.double().log_softmax(-1)[batch.valid].max(-1).values).sum()
        loss.backward()
        results.append((logits.double().detach(), m.model.layers[0].self_attn.q_proj.weight.grad))
    (got, g_got), (want, g_want) = results
    valid = batch.valid
    assert torch.allclose(got[valid], want[valid], atol=tol * 10, rtol=0)
    assert torch.allclose(g_got.double(), g_want, atol=tol * 100 * g_want.abs().max(), rtol=0)


@pytest.mark.parametrize("kernel, dtype", [pytest.param("cuda_flash", torch.bfloat16, id="flash"),
                                           pytest.param("cuda_efficient", torch.float32,
                                                        id="efficient")])
def test_cuda_kernels_run_the_driver_on_meta_tensors(kernel, dtype):
    """No GPU here: the CUDA adapters go through the whole split-KV driver (forward and
    backward, GQA, prefix gathers) on ``meta`` tensors, so their calls match the operators'
    schemas and shapes (the numbers are checked on the ``math`` and CPU kernels above)."""
    from ray_xlong.trajectory.split_kv import (KERNELS, attend_pieces, attend_pieces_backward,
                                               split_kv_plan)

    plan = split_kv_plan(KV_END, VALID)
    q = torch.empty(1, 4, 12, 64, device="meta", dtype=dtype)
    k = torch.empty(1, 2, 12, 64, device="meta", dtype=dtype)
    out, lse, aux = attend_pieces(q, k, k, plan.pieces, kernel=KERNELS[kernel], scale=0.125)
    assert out.shape == q.shape and lse.shape == (1, 4, 12) and lse.dtype == torch.float32
    dq, dk, dv = attend_pieces_backward(out, q, k, k, out, lse, plan.pieces, aux,
                                        kernel=KERNELS[kernel], scale=0.125)
    assert dq.shape == q.shape and dk.shape == dv.shape == k.shape
