"""What the token loss saw: sums over trained tokens that add up across micro-batches and cells.

Per trained target ``i`` (``loss_scale_i > 0``; count-once duplicates carry no weight and are
not counted) with current logprob ``lp``, behaviour logprob ``lp_b``::

    r_i   = exp(lp_i − lp_b_i)                      importance ratio, current ÷ behaviour
    k3_i  = (r_i − 1) − log r_i   ≥ 0               approx KL(behaviour ‖ current), unbiased
    clip  = PPO: r_i outside [1 − ε_lo, 1 + ε_hi]   TIS: r_i > tis_cap (the weight truncated)
    H     ≈ −lp_i                                   entropy estimate on the sampled tokens
    log r_i, max |log r_i|                          rollout / learner mismatch
    masked                                          tokens masked IS dropped (``LossConfig``)
    kl_penalty                                      the loss's KL penalty estimate (k1 / k3)

:class:`LossStats` keeps sums (and min / max), so ``merge`` over micro-batches in any order and
over the cells of a step gives the statistics of the whole step; the means are read off at the
end (:meth:`LossStats.mean`). Pure: torch only, no ray.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from ray_xlong.trajectory.loss import LossConfig, token_terms
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
    log_ratio_sum: float = 0.0
    """Σ ``log r`` (current − behaviour logprob): the mean is the signed mismatch."""
    log_ratio_max: float = 0.0
    """Largest ``|log r|`` (0.0 when no tokens)."""
    masked: int = 0
    """Targets masked IS dropped (token or sequence mask)."""
    kl_penalty_sum: float = 0.0
    """Σ of the KL penalty estimate (``LossConfig.kl_estimator``; 0 without a penalty)."""

    def merge(self, other: "LossStats") -> "LossStats":
        """The statistics of both sets of micro-batches."""
        return LossStats(
            tokens=self.tokens + other.tokens, loss_sum=self.loss_sum + other.loss_sum,
            clipped=self.clipped + other.clipped, ratio_sum=self.ratio_sum + other.ratio_sum,
            ratio_min=min(self.ratio_min, other.ratio_min),
            ratio_max=max(self.ratio_max, other.ratio_max),
            kl_sum=self.kl_sum + other.kl_sum,
            neg_logprob_sum=self.neg_logprob_sum + other.neg_logprob_sum,
            log_ratio_sum=self.log_ratio_sum + other.log_ratio_sum,
            log_ratio_max=max(self.log_ratio_max, other.log_ratio_max),
            masked=self.masked + other.masked,
            kl_penalty_sum=self.kl_penalty_sum + other.kl_penalty_sum)

    def mean(self, name: str) -> float:
        """Per-token mean of a sum or count field (``clipped``, ``ratio_sum``, ``kl_sum``,
        ``neg_logprob_sum``, ``log_ratio_sum``, ``masked``, ``kl_penalty_sum``; 0.0 when no
        tokens were trained)."""
        return float(getattr(self, name)) / self.tokens if self.tokens else 0.0


def loss_stats(logprobs: torch.Tensor, batch: PackedBatch, config: LossConfig, *,
               loss: float, ref_logprobs: torch.Tensor | None = None) -> LossStats:
    """The statistics of one micro-batch.

    Args:
        logprobs: ``[T]`` current logprobs of the batch's targets (detached or not).
        batch: the packed batch.
        config: the loss form (decides the ratio, what counts as clipped and masked).
        loss: the micro-batch's loss value (``policy_loss``'s first output).
        ref_logprobs: ``[T]`` reference logprobs (when the loss's KL penalty needs them).

    Returns:
        :class:`LossStats` over the targets with ``loss_scale > 0``.
    """
    with torch.no_grad():
        lp_all = logprobs.detach().double()
        ref = ref_logprobs.detach().double() if ref_logprobs is not None else None
        t = token_terms(lp_all, batch, config, ref_logprobs=ref)
        keep = batch.loss_scale.to(lp_all.device) > 0
        lp, log_ratio = lp_all[keep], t.log_ratio[keep]
        ratio = t.ratio[keep]
        n = int(lp.numel())
        token_ratio = torch.exp(log_ratio)
        return LossStats(
            tokens=n, loss_sum=float(loss), clipped=int(t.clipped[keep].sum()),
            ratio_sum=float(ratio.sum()),
            ratio_min=float(ratio.min()) if n else math.inf,
            ratio_max=float(ratio.max()) if n else -math.inf,
            kl_sum=float(((token_ratio - 1.0) - log_ratio).sum()),
            neg_logprob_sum=float(-lp.sum()),
            log_ratio_sum=float(log_ratio.sum()),
            log_ratio_max=float(log_ratio.abs().max()) if n else 0.0,
            masked=int((t.mask[keep] == 0).sum()), kl_penalty_sum=float(t.kl[keep].sum()))


@dataclasses.dataclass(frozen=True, slots=True)
class LearnerStepStats:
    """What one learner did for one step (sent from the learner actor to the driver)."""

    version: int
    """The policy version the step trained (its result is ``version + 1``)."""
    loss: LossStats
    """Loss diagnostics summed over this learner's micro-batches."""
    train_s: float
    """Seconds in forward / backward of the micro-batches."""
    apply_s: float
    """Seconds of the optimizer step (reduce sum, clip, Adam)."""
    grad_norm: float
    """Global norm of the reduced gradient before clipping (nan if no step applied)."""
    total: float
    """The step's normalizer (the reduced gradient is Σ grads ÷ total; nan if none applied)."""

    def merge_ranks(self, other: "LearnerStepStats") -> "LearnerStepStats":
        """The report of one cell from two of its ranks: each rank trained its own targets (its
        rows, or its token ranges of a row under context parallelism), so the loss sums add;
        the ranks ran side by side (the slowest one's seconds); the gradient norm and the
        normalizer are the cell's, the same on every rank that applied the step."""
        return LearnerStepStats(
            self.version, self.loss.merge(other.loss), max(self.train_s, other.train_s),
            max(self.apply_s, other.apply_s),
            self.grad_norm if math.isfinite(self.grad_norm) else other.grad_norm,
            self.total if math.isfinite(self.total) else other.total)


class StepStatsLog:
    """A Learner's :class:`LearnerStepStats` by the version each step trained, kept until
    taken (``take_step_stats``); a job that never takes them keeps the last :attr:`KEEP`."""

    KEEP = 64
    """Versions kept at most (older ones are dropped when a new one starts)."""

    def __init__(self) -> None:
        self.by_version: dict[int, LearnerStepStats] = {}

    def note(self, version: int, *, loss: LossStats = LossStats(), train_s: float = 0.0,
             apply_s: float = 0.0, grad_norm: float | None = None,
             total: float | None = None) -> None:
        """Add to the report of the step that trains ``version``."""
        old = self.by_version.get(version)
        if old is None:
            old = LearnerStepStats(version, LossStats(), 0.0, 0.0, math.nan, math.nan)
            for v in sorted(self.by_version)[:max(0, len(self.by_version) - self.KEEP + 1)]:
                del self.by_version[v]
        self.by_version[version] = LearnerStepStats(
            version, old.loss.merge(loss), old.train_s + train_s, old.apply_s + apply_s,
            old.grad_norm if grad_norm is None else grad_norm,
            old.total if total is None else total)

    def take(self, version: int) -> LearnerStepStats | None:
        """The report of the step that trained ``version`` (None: no part in it); forgets it
        and anything older."""
        out = self.by_version.get(version)
        self.by_version = {v: s for v, s in self.by_version.items() if v > version}
        return out
