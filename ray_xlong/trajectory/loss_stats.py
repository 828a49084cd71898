"""What the token loss saw: sums over trained tokens that add up across micro-batches and cells.

Per trained target ``i`` (``loss_scale_i > 0``; count-once duplicates carry no weight and are
not counted) with current logprob ``lp``, behaviour logprob ``lp_b``::

    r_i   = exp(lp_i − lp_b_i)                      importance ratio, current ÷ behaviour
    k3_i  = (r_i − 1) − log r_i   ≥ 0               approx KL(behaviour ‖ current), unbiased
    clip  = PPO: r_i outside [1 − ε_lo, 1 + ε_hi]   TIS: r_i > tis_cap (the weight truncated)
    H     ≈ −lp_i                                   entropy estimate on the sampled tokens

:class:`LossStats` keeps sums (and min / max), so ``merge`` over micro-batches in any order and
over the cells of a step gives the statistics of the whole step; the means are read off at the
end (:meth:`LossStats.mean`). Pure: torch only, no ray.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from ray_xlong.trajectory.loss import LossConfig
from ray_xlong.trajectory.packing import PackedBatch


@dataclasses.dataclass(frozen=True, slots=True)
class LossStats:
    """Sums of the loss diagnostics over the trained tokens of some micro-batches."""

    tokens: int = 0
    """Trained targets (``loss_scale > 0``)."""
    loss_sum: float = 0.0
    """Σ of the micro-batches' losses (``Σ loss_scale · ℓ``, un-normalised)."""
    clipped: int = 0
    """Targets whose ratio PPO clipped (or TIS truncated)."""
    ratio_sum: float = 0.0
    """Σ importance ratio."""
    ratio_min: float = math.inf
    """Smallest importance ratio (inf when no tokens)."""
    ratio_max: float = -math.inf
    """Largest importance ratio (−inf when no tokens)."""
    kl_sum: float = 0.0
    """Σ ``(r − 1) − log r`` (the k3 estimator of KL(behaviour ‖ current))."""
    neg_logprob_sum: float = 0.0
    """Σ ``−lp`` under the current policy (entropy estimate on the sampled tokens)."""

    def merge(self, other: "LossStats") -> "LossStats":
        """The statistics of both sets of micro-batches."""
        return LossStats(
            tokens=self.tokens + other.tokens, loss_sum=self.loss_sum + other.loss_sum,
            clipped=self.clipped + other.clipped, ratio_sum=self.ratio_sum + other.ratio_sum,
            ratio_min=min(self.ratio_min, other.ratio_min),
            ratio_max=max(self.ratio_max, other.ratio_max),
            kl_sum=self.kl_sum + other.kl_sum,
            neg_logprob_sum=self.neg_logprob_sum + other.neg_logprob_sum)

    def mean(self, name: str) -> float:
        """Per-token mean of ``clipped`` / ``ratio_sum`` / ``kl_sum`` / ``neg_logprob_sum``
        (0.0 when no tokens were trained)."""
        return float(getattr(self, name)) / self.tokens if self.tokens else 0.0


def loss_stats(logprobs: torch.Tensor, batch: PackedBatch, config: LossConfig, *,
               loss: float) -> LossStats:
    """The statistics of one micro-batch.

    Args:
        logprobs: ``[T]`` current logprobs of the batch's targets (detached or not).
        batch: the packed batch.
        config: the loss form (decides what counts as clipped).
        loss: the micro-batch's loss value (``policy_loss``'s first output).

    Returns:
        :class:`LossStats` over the targets with ``loss_scale > 0``.
    """
    with torch.no_grad():
        keep = batch.loss_scale.to(logprobs.device) > 0
        lp = logprobs.detach().double()[keep]
        log_ratio = lp - batch.behaviour_logprobs.to(lp.device).double()[keep]
        ratio = torch.exp(log_ratio)
        if config.kind == "ppo_clip":
            clipped = (ratio < 1.0 - config.clip_low) | (ratio > 1.0 + config.clip_high)
        else:
            clipped = ratio > config.tis_cap
        n = int(lp.numel())
        return LossStats(
            tokens=n, loss_sum=float(loss), clipped=int(clipped.sum()),
            ratio_sum=float(ratio.sum()),
            ratio_min=float(ratio.min()) if n else math.inf,
            ratio_max=float(ratio.max()) if n else -math.inf,
            kl_sum=float(((ratio - 1.0) - log_ratio).sum()), neg_logprob_sum=float(-lp.sum()))
