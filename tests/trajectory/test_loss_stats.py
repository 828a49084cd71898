"""Loss statistics: what a hand computation over the trained tokens gives, and the same over a
batch split into micro-batches and merged in any order (sums add; min / max combine)."""

from __future__ import annotations

import math

import pytest
import torch

from ray_xlong.trajectory import LossConfig, ProcessorConfig, TrajectoryProcessor, policy_loss
from ray_xlong.trajectory.loss_stats import (LearnerStepStats, LossStats, StepStatsLog,
                                             loss_stats)
from ray_xlong.trajectory.packing import micro_batches
from ray_xlong.trajectory.synthetic import SyntheticConfig, synthetic_runs


@pytest.fixture(scope="module")
def packed():
    cfg = SyntheticConfig(num_calls=8, vocab_size=64, context_budget=120, failed_prob=0.0)
    runs = synthetic_runs(3, groups=2, runs_per_group=3, config=cfg)
    return TrajectoryProcessor(ProcessorConfig(row_tokens=256)).process(runs).packed


def current_logprobs(batch, seed=0):
    """Behaviour logprobs moved by ±0.5 at random: some ratios leave the clip range."""
    g = torch.Generator().manual_seed(seed)
    noise = (torch.rand(batch.num_targets, generator=g) - 0.5)
    return batch.behaviour_logprobs.double() + noise.double()


@pytest.mark.parametrize("config", [
    pytest.param(LossConfig(), id="ppo_clip"),
    pytest.param(LossConfig(kind="tis", tis_cap=1.1), id="tis"),
])
def test_stats_match_a_hand_computation(packed, config):
    lp = current_logprobs(packed)
    loss, _ = policy_loss(lp, packed, config)
    s = loss_stats(lp, packed, config, loss=float(loss))
    keep = packed.loss_scale > 0
    r = torch.exp(lp[keep] - packed.behaviour_logprobs.double()[keep])
    if config.kind == "ppo_clip":
        clipped = ((r < 0.8) | (r > 1.28)).sum()
    else:
        clipped = (r > 1.1).sum()
    assert s.tokens == int(keep.sum()) > 0
    assert s.clipped == int(clipped) > 0
    assert s.mean("ratio_sum") == pytest.approx(float(r.mean()))
    assert (s.ratio_min, s.ratio_max) == pytest.approx((float(r.min()), float(r.max())))
    assert s.mean("kl_sum") == pytest.approx(float(((r - 1) - torch.log(r)).mean()))
    assert s.mean("kl_sum") > 0
    assert s.mean("neg_logprob_sum") == pytest.approx(float(-lp[keep].mean()))
    assert s.loss_sum == pytest.approx(float(loss))


def test_micro_batches_merge_to_the_whole_batch(packed):
    config = LossConfig()
    whole_lp = current_logprobs(packed)
    whole = loss_stats(whole_lp, packed, config, loss=float(policy_loss(whole_lp, packed,
                                                                        config)[0]))
    parts = micro_batches(packed, max_tokens=300)
    assert len(parts) > 1
    merged, offset = LossStats(), 0
    # micro-batches keep the targets in order: slice the same logprobs for each
    for part in reversed(parts):       # any order
        n = part.num_targets
        start = sum(p.num_targets for p in parts[:parts.index(part)])
        lp = whole_lp[start:start + n]
        merged = merged.merge(loss_stats(lp, part, config,
                                         loss=float(policy_loss(lp, part, config)[0])))
        offset += n
    assert offset == packed.num_targets
    assert (merged.tokens, merged.clipped) == (whole.tokens, whole.clipped)
    for name in ("loss_sum", "ratio_sum", "ratio_min", "ratio_max", "kl_sum",
                 "neg_logprob_sum"):
        assert getattr(merged, name) == pytest.approx(getattr(whole, name)), name


def test_empty_stats_have_zero_means():
    s = LossStats()
    assert s.tokens == 0 and s.mean("kl_sum") == 0.0
    assert s.ratio_min == math.inf and s.merge(s) == s


def test_a_learners_step_reports_add_up_and_are_taken_once():
    log = StepStatsLog()
    log.note(3, loss=LossStats(tokens=2, loss_sum=1.0), train_s=0.5)
    log.note(3, loss=LossStats(tokens=3, loss_sum=2.0), train_s=0.25)
    log.note(3, apply_s=0.1, grad_norm=4.0, total=5.0)
    log.note(4, loss=LossStats(tokens=1))
    got = log.take(3)
    assert (got.version, got.loss.tokens, got.loss.loss_sum, got.train_s, got.apply_s,
            got.grad_norm, got.total) == (3, 5, 3.0, 0.75, 0.1, 4.0, 5.0)
    assert log.take(3) is None and log.take(4).loss.tokens == 1
    for v in range(StepStatsLog.KEEP + 10):     # a job that never takes them keeps the last
        log.note(v, loss=LossStats(tokens=1))
    assert sorted(log.by_version) == list(range(10, StepStatsLog.KEEP + 10))


def test_a_cells_ranks_merge_into_the_cells_report():
    from ray_xlong.cells.rank_joins import merge_rank_stats

    rank0 = LearnerStepStats(7, LossStats(tokens=4, loss_sum=1.0, ratio_min=0.9, ratio_max=1.1,
                                          log_ratio_max=0.1), 2.0, 0.5, 3.0, 8.0)
    rank1 = LearnerStepStats(7, LossStats(tokens=6, loss_sum=-0.5, ratio_min=0.8, ratio_max=1.0,
                                          log_ratio_max=0.2), 3.0, 0.25, 3.0, 8.0)
    cell = merge_rank_stats([rank0, None, rank1])
    assert cell.loss.tokens == 10 and cell.loss.loss_sum == 0.5
    assert (cell.loss.ratio_min, cell.loss.ratio_max, cell.loss.log_ratio_max) == (0.8, 1.1, 0.2)
    assert (cell.train_s, cell.apply_s, cell.grad_norm, cell.total) == (3.0, 0.5, 3.0, 8.0)
    assert merge_rank_stats([None, None]) is None
    no_step = LearnerStepStats(7, LossStats(tokens=1), 1.0, 0.0, math.nan, math.nan)
    assert merge_rank_stats([no_step, rank1]).grad_norm == 3.0
