"""Off-policy corrections of the token loss (``trajectory/loss.py``): every form checked against a
whole-batch reference computed here run by run with plain Python floats, the micro-batches of a
tree-packed batch adding up to it (loss, gradient, statistics), and the config refusing bad
fields by name."""

from __future__ import annotations

import math

import pytest
import torch

from ray_xlong.trajectory import LossConfig, ProcessorConfig, TrajectoryProcessor, policy_loss
from ray_xlong.trajectory.loss_stats import LossStats, loss_stats
from ray_xlong.trajectory.packing import micro_batches
from ray_xlong.trajectory.synthetic import SyntheticConfig, synthetic_runs

CONFIGS = [
    pytest.param(LossConfig(), id="ppo-token"),
    pytest.param(LossConfig(ratio_level="sequence"), id="ppo-sequence"),
    pytest.param(LossConfig(ratio_level="geo_mean"), id="ppo-geo_mean"),
    pytest.param(LossConfig(kind="tis", ratio_level="geo_mean", tis_cap=1.05), id="tis-geo"),
    pytest.param(LossConfig(kind="tis", ratio_level="sequence", tis_cap=3.0), id="tis-seq"),
    pytest.param(LossConfig(token_mask=(0.8, 1.25)), id="mask-token"),
    pytest.param(LossConfig(sequence_mask=(0.99, 1.01)), id="mask-sequence"),
    pytest.param(LossConfig(kind="tis", token_mask=(0.7, 1.4), sequence_mask=(0.98, 1.03)),
                 id="tis-mask-both"),
    pytest.param(LossConfig(kl_coef=0.1, kl_estimator="k1"), id="kl-k1-behaviour"),
    pytest.param(LossConfig(kl_coef=0.1, kl_estimator="k3", kl_reference="reference"),
                 id="kl-k3-reference"),
]


@pytest.fixture(scope="module")
def packed():
    cfg = SyntheticConfig(num_calls=8, vocab_size=64, context_budget=120, failed_prob=0.0)
    runs = synthetic_runs(5, groups=2, runs_per_group=3, config=cfg)
    return TrajectoryProcessor(ProcessorConfig(row_tokens=256, pack="tree")).process(runs).packed


def moved(batch, seed, scale=0.5):
    """Behaviour logprobs moved by ±scale/2 at random (fp64)."""
    g = torch.Generator().manual_seed(seed)
    noise = (torch.rand(batch.num_targets, generator=g) - 0.5) * scale
    return batch.behaviour_logprobs.double() + noise.double()


def reference_loss(lp, ref, batch, c: LossConfig) -> tuple[float, int]:
    """The loss of the module docstring, token by token in Python floats; and masked count."""
    lp, ref = lp.tolist(), ref.tolist()
    old, adv = batch.behaviour_logprobs.tolist(), batch.advantages.tolist()
    scale, run = batch.loss_scale.tolist(), batch.target_run.tolist()
    by_run: dict[int, list[float]] = {}
    for i in range(len(lp)):
        if scale[i] > 0:
            by_run.setdefault(run[i], []).append(lp[i] - old[i])
    total, masked = 0.0, 0
    for i in range(len(lp)):
        logs = by_run.get(run[i], [0.0])
        rho = {"token": math.exp(lp[i] - old[i]), "sequence": math.exp(sum(logs)),
               "geo_mean": math.exp(sum(logs) / len(logs))}[c.ratio_level]
        if c.kind == "ppo_clip":
            clipped = min(max(rho, 1 - c.clip_low), 1 + c.clip_high)
            loss = -min(rho * adv[i], clipped * adv[i])
        else:
            loss = -min(rho, c.tis_cap) * adv[i] * lp[i]
        keep = True
        if c.token_mask is not None:
            keep &= c.token_mask[0] <= math.exp(lp[i] - old[i]) <= c.token_mask[1]
        if c.sequence_mask is not None:
            keep &= c.sequence_mask[0] <= math.exp(sum(logs) / len(logs)) <= c.sequence_mask[1]
        masked += (not keep) and scale[i] > 0
        d = lp[i] - (ref[i] if c.kl_reference == "reference" else old[i])
        kl = d if c.kl_estimator == "k1" else math.exp(-d) - 1 + d
        total += scale[i] * ((loss if keep else 0.0) + c.kl_coef * kl)
    return total, masked


@pytest.mark.parametrize("config", CONFIGS)
def test_loss_matches_the_whole_batch_reference(packed, config):
    lp, ref = moved(packed, 0), moved(packed, 1)
    loss, stats = policy_loss(lp, packed, config, ref_logprobs=ref)
    want, masked = reference_loss(lp, ref, packed, config)
    assert float(loss) == pytest.approx(want, rel=1e-9, abs=1e-12)
    s = loss_stats(lp, packed, config, loss=float(loss), ref_logprobs=ref)
    assert s.masked == masked
    if config.token_mask is not None or config.sequence_mask is not None:
        assert 0 < masked < s.tokens       # the thresholds bite, but not everywhere
    keep = packed.loss_scale > 0
    log_r = (lp - packed.behaviour_logprobs.double())[keep]
    assert s.mean("log_ratio_sum") == pytest.approx(float(log_r.mean()))
    assert s.log_ratio_max == pytest.approx(float(log_r.abs().max()))
    assert stats["masked_frac"] == pytest.approx(masked / packed.num_targets)


@pytest.mark.parametrize("config", CONFIGS)
def test_micro_batches_add_up_to_the_whole_batch(packed, config):
    """Loss, gradient w.r.t. the logprobs and statistics: Σ micro-batches == whole batch."""
    base, ref = moved(packed, 2), moved(packed, 3)
    whole_lp = base.clone().requires_grad_(True)
    whole, _ = policy_loss(whole_lp, packed, config, ref_logprobs=ref)
    whole.backward()
    whole_stats = loss_stats(whole_lp, packed, config, loss=float(whole.detach()), ref_logprobs=ref)
    parts = micro_batches(packed, max_tokens=300)
    assert len(parts) > 1
    total, grads, merged, at = 0.0, [], LossStats(), 0
    for part in parts:
        n = part.num_targets
        lp = base[at:at + n].clone().requires_grad_(True)
        loss, _ = policy_loss(lp, part, config, ref_logprobs=ref[at:at + n])
        loss.backward()
        total += float(loss.detach())
        grads.append(lp.grad)
        merged = merged.merge(loss_stats(lp, part, config, loss=float(loss.detach()),
                                         ref_logprobs=ref[at:at + n]))
        at += n
    assert at == packed.num_targets
    assert total == pytest.approx(float(whole.detach()), rel=1e-9, abs=1e-12)
    torch.testing.assert_close(torch.cat(grads), whole_lp.grad, rtol=1e-9, atol=1e-12)
    assert merged.masked == whole_stats.masked
    assert merged.kl_penalty_sum == pytest.approx(whole_stats.kl_penalty_sum)
    assert merged.log_ratio_max == pytest.approx(whole_stats.log_ratio_max)


def test_sequence_ratio_gradient_reaches_every_token_of_the_run(packed):
    """GSPO: with a geometric-mean ratio inside the clip range, ∂loss/∂lp_i is the same for
    every token of a run (the ratio depends on all of them)."""
    lp = packed.behaviour_logprobs.double().clone().requires_grad_(True)
    loss, _ = policy_loss(lp, packed, LossConfig(ratio_level="geo_mean"))
    loss.backward()
    run0 = (packed.target_run == 0) & (packed.loss_scale > 0)
    g = lp.grad[run0]
    assert g.abs().min() > 0
    torch.testing.assert_close(g, torch.full_like(g, float(g[0])))


def test_reference_kl_needs_reference_logprobs(packed):
    with pytest.raises(ValueError, match="ref_logprobs"):
        policy_loss(moved(packed, 0), packed, LossConfig(kl_coef=0.1, kl_reference="reference"))


@pytest.mark.parametrize("field,value", [
    ("ratio_level", "run"), ("kl_estimator", "k2"), ("kl_reference", "sft"),
    ("kl_coef", -0.1), ("token_mask", (2.0, 1.0)), ("sequence_mask", [0.5, 2.0]),
])
def test_bad_fields_are_named(field, value):
    with pytest.raises(ValueError, match=f"LossConfig.{field}"):
        LossConfig(**{field: value})
