"""Token-level policy-gradient loss on a :class:`PackedBatch` (either layout).

Per target token ``i`` with current logprob ``lp``, behaviour logprob ``lp_b``, advantage ``A``::

    ratio_i = exp(lp_i − lp_b_i)
    PPO clip:          ℓ_i = −min(ratio_i · A_i, clip(ratio_i, 1 − ε_lo, 1 + ε_hi) · A_i)
    truncated IS:      ℓ_i = −min(ratio_i, c).detach() · A_i · lp_i      (c = ``tis_cap``)
    loss = Σ_i loss_scale_i · ℓ_i

``loss_scale`` carries count-once (each unique trainable token once per run) and the normalizer
(default: ÷ unique trainable tokens of the batch), so the loss of a batch split into micro-batches
is the sum of the micro-batches' losses: gradient accumulation needs no rescaling.
"""

from __future__ import annotations

import dataclasses

import torch

from ray_xlong.trajectory.packing import PackedBatch


@dataclasses.dataclass(frozen=True, slots=True)
class LossConfig:
    """How token losses are formed."""

    kind: str = "ppo_clip"
    """``ppo_clip`` | ``tis`` (truncated importance sampling, REINFORCE-style)."""
    clip_low: float = 0.2
    """PPO: lower clip ε (ratio >= 1 − ε)."""
    clip_high: float = 0.28
    """PPO: upper clip ε (ratio <= 1 + ε; "clip-higher")."""
    tis_cap: float = 2.0
    """TIS: cap of the (detached) importance ratio."""

    def __post_init__(self) -> None:
        if self.kind not in ("ppo_clip", "tis"):
            raise ValueError(f"LossConfig.kind must be 'ppo_clip' or 'tis', got {self.kind!r}")
        for name in ("clip_low", "clip_high", "tis_cap"):
            if not getattr(self, name) > 0:
                raise ValueError(f"LossConfig.{name} must be > 0, got {getattr(self, name)}")


def policy_loss(logprobs: torch.Tensor, batch: PackedBatch,
                config: LossConfig = LossConfig()) -> tuple[torch.Tensor, dict[str, float]]:
    """The scalar loss and a few diagnostics.

    Args:
        logprobs: ``[T]`` current logprobs (from :func:`token_logprobs`).
        batch: the packed batch they were computed on.
        config: the loss form.

    Returns:
        ``(loss, stats)``; stats: ``ratio_mean``, ``clip_frac``, ``approx_kl``.
    """
    device = logprobs.device
    old = batch.behaviour_logprobs.to(device, logprobs.dtype)
    adv = batch.advantages.to(device, logprobs.dtype)
    scale = batch.loss_scale.to(device, logprobs.dtype)
    log_ratio = logprobs - old
    ratio = torch.exp(log_ratio)
    if config.kind == "ppo_clip":
        clipped = ratio.clamp(1.0 - config.clip_low, 1.0 + config.clip_high)
        token_loss = -torch.minimum(ratio * adv, clipped * adv)
        clip_frac = (clipped != ratio).float()
    else:
        weight = ratio.detach().clamp(max=config.tis_cap)
        token_loss = -weight * adv * logprobs
        clip_frac = (ratio.detach() > config.tis_cap).float()
    loss = (scale * token_loss).sum()
    with torch.no_grad():
        n = max(logprobs.numel(), 1)
        stats = {"ratio_mean": float(ratio.sum() / n), "clip_frac": float(clip_frac.sum() / n),
                 "approx_kl": float(((ratio - 1) - log_ratio).sum() / n)}
    return loss, stats
