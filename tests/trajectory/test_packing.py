"""Packing details: layouts, row budgets, micro-batches (the property tests cover the rest)."""

from __future__ import annotations

import pytest
import torch

from ray_xlong.models import TinyModelConfig, tiny_causal_lm
from ray_xlong.trajectory import LossConfig, ProcessorConfig, TrajectoryProcessor, policy_loss
from ray_xlong.trajectory.model import token_logprobs
from ray_xlong.trajectory.packing import micro_batches
from ray_xlong.trajectory.synthetic import SyntheticConfig, synthetic_runs


def batch(layout, row_tokens=64):
    runs = synthetic_runs(1, groups=2, runs_per_group=3, config=SyntheticConfig.small())
    return TrajectoryProcessor(ProcessorConfig(pack=layout, row_tokens=row_tokens)).process(runs)


@pytest.mark.parametrize("layout", ["tree", "per_trajectory"])
@pytest.mark.parametrize("max_tokens", [1, 50, 10_000])
def test_micro_batches_cover_every_target_once(layout, max_tokens):
    packed = batch(layout).packed
    parts = micro_batches(packed, max_tokens=max_tokens)
    assert sum(p.input_ids.shape[0] for p in parts) == packed.input_ids.shape[0]
    assert torch.equal(torch.cat([p.target_ids for p in parts]), packed.target_ids)
    assert torch.equal(torch.cat([p.loss_scale for p in parts]), packed.loss_scale)
    for p in parts:
        rows, width = p.input_ids.shape
        assert rows == 1 or rows * width <= max_tokens
        assert int(p.target_src.max()) < width and int(p.target_row.max()) < rows


def test_micro_batch_losses_sum_to_the_batch_loss():
    model = tiny_causal_lm(TinyModelConfig(vocab_size=32), dtype=torch.float64)
    packed = batch("tree").packed
    whole, _ = policy_loss(token_logprobs(model, packed), packed, LossConfig())
    parts = sum(policy_loss(token_logprobs(model, p), p, LossConfig())[0]
                for p in micro_batches(packed, max_tokens=1))
    assert abs((whole - parts).item()) < 1e-12


def test_row_budget_packs_runs_together_and_big_runs_alone():
    one_each = batch("tree", row_tokens=None).packed
    packed = batch("tree", row_tokens=10_000).packed
    assert one_each.input_ids.shape[0] == len(one_each.run_ids)
    assert packed.input_ids.shape[0] == 1
    assert packed.num_positions == one_each.num_positions
    tiny_budget = batch("tree", row_tokens=1).packed
    assert tiny_budget.input_ids.shape[0] == len(tiny_budget.run_ids)


def test_tree_layout_computes_fewer_positions():
    tree, flat = batch("tree").packed, batch("per_trajectory").packed
    assert tree.num_targets == flat.num_targets
    assert tree.num_positions < flat.num_positions
    assert "layout=tree" in repr(tree)


def test_unknown_layout_is_rejected():
    from ray_xlong.trajectory import pack
    with pytest.raises(ValueError, match="layout"):
        pack([], layout="ragged")
