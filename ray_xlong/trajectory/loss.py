"""Token-level policy-gradient loss on a :class:`PackedBatch` (either layout), with off-policy
corrections.

Per target token ``i`` of run ``s`` with current logprob ``lp``, behaviour logprob ``lp_b``
(what the rollout engine reported), advantage ``A``; sums over the run's trained targets::

    log r_i = lp_i − lp_b_i                                   token log-ratio (mismatch)
    ratio_level  token:     ρ_i = r_i
                 sequence:  ρ_i = exp(Σ_{j∈s} log r_j)        the run's likelihood ratio
                 geo_mean:  ρ_i = exp(mean_{j∈s} log r_j)     GSPO's length-normalised ratio
    PPO clip:          ℓ_i = −min(ρ_i · A_i, clip(ρ_i, 1 − ε_lo, 1 + ε_hi) · A_i)
    truncated IS:      ℓ_i = −min(ρ_i, c).detach() · A_i · lp_i          (c = ``tis_cap``)
    masked IS:         m_i = [lo_t <= r_i <= hi_t] · [lo_s <= exp(mean_{j∈s} log r_j) <= hi_s]
    KL penalty:        d_i = lp_i − lp_ref_i  (ref = behaviour or a reference policy)
                       k1_i = d_i       k3_i = exp(−d_i) − 1 + d_i   (>= 0)
    loss = Σ_i loss_scale_i · (m_i · ℓ_i + β · k_i)

``loss_scale`` carries count-once (each unique trainable token once per run) and the normalizer
(default: ÷ unique trainable tokens of the batch), so the loss of a batch split into micro-batches
is the sum of the micro-batches' losses: gradient accumulation needs no rescaling. A masked
token contributes zero; the normalizer is unchanged. Sequence quantities are taken over the
run's targets in the batch given: with tree packing a run's tree is one row, so a micro-batch
holds every target of its runs and the micro-batches add up to the whole batch exactly.
Sequence log-ratios are clamped to ±``SEQ_LOG_RATIO_CLAMP`` before ``exp`` (finite in fp32).
"""

from __future__ import annotations

import dataclasses

import torch

from ray_xlong.trajectory.packing import PackedBatch

RATIO_LEVELS = ("token", "sequence", "geo_mean")
"""Valid ``LossConfig.ratio_level`` values."""
KL_ESTIMATORS = ("k1", "k3")
"""Valid ``LossConfig.kl_estimator`` values."""
KL_REFERENCES = ("behaviour", "reference")
"""Valid ``LossConfig.kl_reference`` values."""
SEQ_LOG_RATIO_CLAMP = 20.0
"""|Σ log r| of a sequence ratio is clamped to this before ``exp`` (e^20 ≈ 4.9e8)."""


@dataclasses.dataclass(frozen=True, slots=True)
class LossConfig:
    """How token losses are formed (module docstring for the formulas)."""

    kind: str = "ppo_clip"
    """``ppo_clip`` | ``tis`` (truncated importance sampling, REINFORCE-style)."""
    clip_low: float = 0.2
    """PPO: lower clip ε (ratio >= 1 − ε)."""
    clip_high: float = 0.28
    """PPO: upper clip ε (ratio <= 1 + ε; "clip-higher")."""
    tis_cap: float = 2.0
    """TIS: cap of the (detached) importance ratio."""
    ratio_level: str = "token"
    """Importance ratio the loss uses: ``token`` (per token), ``sequence`` (the run's product
    of token ratios, on every token of the run) or ``geo_mean`` (its geometric mean, GSPO)."""
    token_mask: tuple[float, float] | None = None
    """Masked IS at token level: ``(lo, hi)`` keeps tokens with ``lo <= r_i <= hi`` (others
    carry no policy loss). None: off."""
    sequence_mask: tuple[float, float] | None = None
    """Masked IS at sequence level: ``(lo, hi)`` keeps runs whose geometric-mean ratio lies in
    ``[lo, hi]``; every token of another run carries no policy loss. None: off."""
    kl_coef: float = 0.0
    """β of the KL penalty (0: no penalty)."""
    kl_estimator: str = "k3"
    """``k1`` (log-ratio) | ``k3`` (``exp(−d) − 1 + d``, non-negative, low variance)."""
    kl_reference: str = "behaviour"
    """Penalty towards ``behaviour`` (the rollout logprobs) or ``reference`` (a frozen
    reference policy's logprobs, e.g. the starting weights: the Learner computes them)."""

    def __post_init__(self) -> None:
        _one_of("kind", self.kind, ("ppo_clip", "tis"))
        _one_of("ratio_level", self.ratio_level, RATIO_LEVELS)
        _one_of("kl_estimator", self.kl_estimator, KL_ESTIMATORS)
        _one_of("kl_reference", self.kl_reference, KL_REFERENCES)
        for name in ("clip_low", "clip_high", "tis_cap"):
            if not getattr(self, name) > 0:
                raise ValueError(f"LossConfig.{name} must be > 0, got {getattr(self, name)}")
        if not self.kl_coef >= 0:
            raise ValueError(f"LossConfig.kl_coef must be >= 0, got {self.kl_coef!r}")
        for name in ("token_mask", "sequence_mask"):
            bounds = getattr(self, name)
            if bounds is not None and not (isinstance(bounds, tuple) and len(bounds) == 2
                                           and 0 <= bounds[0] < bounds[1]):
                raise ValueError(f"LossConfig.{name} must be None or (lo, hi) with "
                                 f"0 <= lo < hi, got {bounds!r}")

    @property
    def needs_reference(self) -> bool:
        """True when the loss needs a reference policy's logprobs."""
        return self.kl_coef > 0 and self.kl_reference == "reference"


def _one_of(field: str, value: object, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"LossConfig.{field} must be one of {allowed}, got {value!r}")


@dataclasses.dataclass(frozen=True, slots=True)
class TokenTerms:
    """Per-target pieces of the loss (``[T]`` tensors), shared by the loss and its stats."""

    log_ratio: torch.Tensor
    """``lp − lp_b`` (with gradient)."""
    ratio: torch.Tensor
    """ρ: the importance ratio the loss uses (``ratio_level``; with gradient)."""
    mask: torch.Tensor
    """1.0 where the token carries policy loss, 0.0 where masked IS dropped it."""
    clipped: torch.Tensor
    """bool: PPO clipped ρ (TIS: truncated it)."""
    kl: torch.Tensor
    """The KL penalty estimate per token (zeros when ``kl_coef == 0``; with gradient)."""


def token_terms(logprobs: torch.Tensor, batch: PackedBatch, config: LossConfig, *,
                ref_logprobs: torch.Tensor | None = None) -> TokenTerms:
    """The per-target terms of the loss (see the module docstring).

    Args:
        logprobs: ``[T]`` current logprobs.
        batch: the packed batch they were computed on.
        config: the loss form.
        ref_logprobs: ``[T]`` reference-policy logprobs (required when
            ``config.needs_reference``).
    """
    dt, dev = logprobs.dtype, logprobs.device
    log_ratio = logprobs - batch.behaviour_logprobs.to(dev, dt)
    trained = batch.loss_scale.to(dev) > 0
    seq_sum, seq_mean = _run_log_ratios(log_ratio, batch.target_run.to(dev), trained,
                                        len(batch.run_ids))
    run = batch.target_run.to(dev)
    if config.ratio_level == "token":
        ratio = torch.exp(log_ratio)
    else:
        per_run = seq_sum if config.ratio_level == "sequence" else seq_mean
        ratio = torch.exp(per_run.clamp(-SEQ_LOG_RATIO_CLAMP, SEQ_LOG_RATIO_CLAMP)[run])
    mask = torch.ones_like(log_ratio)
    with torch.no_grad():
        if config.token_mask is not None:
            r = torch.exp(log_ratio)
            mask = mask * ((r >= config.token_mask[0]) & (r <= config.token_mask[1])).to(dt)
        if config.sequence_mask is not None:
            g = torch.exp(seq_mean)[run]
            lo, hi = config.sequence_mask
            mask = mask * ((g >= lo) & (g <= hi)).to(dt)
        if config.kind == "ppo_clip":
            clipped = (ratio < 1.0 - config.clip_low) | (ratio > 1.0 + config.clip_high)
        else:
            clipped = ratio > config.tis_cap
    return TokenTerms(log_ratio, ratio, mask, clipped,
                      _kl(logprobs, batch, config, ref_logprobs))


def _run_log_ratios(log_ratio: torch.Tensor, run: torch.Tensor, trained: torch.Tensor,
                    runs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``([runs] Σ log r, [runs] mean log r)`` over each run's trained targets."""
    weight = trained.to(log_ratio.dtype)
    total = torch.zeros(runs, dtype=log_ratio.dtype, device=log_ratio.device)
    total = total.index_add(0, run, log_ratio * weight)
    count = torch.zeros_like(total).index_add(0, run, weight)
    return total, total / count.clamp_min(1.0)


def _kl(logprobs: torch.Tensor, batch: PackedBatch, config: LossConfig,
        ref_logprobs: torch.Tensor | None) -> torch.Tensor:
    if config.kl_coef == 0:
        return torch.zeros_like(logprobs)
    if config.kl_reference == "reference":
        if ref_logprobs is None:
            raise ValueError("policy_loss: LossConfig.kl_reference='reference' needs "
                             "ref_logprobs (the reference policy's logprobs of the targets)")
        ref = ref_logprobs.to(logprobs.device, logprobs.dtype)
    else:
        ref = batch.behaviour_logprobs.to(logprobs.device, logprobs.dtype)
    d = logprobs - ref
    return d if config.kl_estimator == "k1" else torch.exp(-d) - 1.0 + d


def policy_loss(logprobs: torch.Tensor, batch: PackedBatch,
                config: LossConfig = LossConfig(), *,
                ref_logprobs: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """The scalar loss and a few diagnostics.

    Args:
        logprobs: ``[T]`` current logprobs (from :func:`token_logprobs`).
        batch: the packed batch they were computed on.
        config: the loss form.
        ref_logprobs: ``[T]`` reference-policy logprobs (only for ``kl_reference='reference'``).

    Returns:
        ``(loss, stats)``; stats: ``ratio_mean``, ``clip_frac``, ``approx_kl``,
        ``log_ratio_mean``, ``log_ratio_max`` (max |log r|), ``masked_frac``, ``kl_penalty``
        (per-target means).
    """
    t = token_terms(logprobs, batch, config, ref_logprobs=ref_logprobs)
    adv = batch.advantages.to(logprobs.device, logprobs.dtype)
    scale = batch.loss_scale.to(logprobs.device, logprobs.dtype)
    if config.kind == "ppo_clip":
        clipped = t.ratio.clamp(1.0 - config.clip_low, 1.0 + config.clip_high)
        token_loss = -torch.minimum(t.ratio * adv, clipped * adv)
    else:
        token_loss = -t.ratio.detach().clamp(max=config.tis_cap) * adv * logprobs
    loss = (scale * (t.mask * token_loss + config.kl_coef * t.kl)).sum()
    with torch.no_grad():
        n = max(logprobs.numel(), 1)
        r = torch.exp(t.log_ratio)
        stats = {"ratio_mean": float(t.ratio.sum() / n),
                 "clip_frac": float(t.clipped.float().sum() / n),
                 "approx_kl": float(((r - 1) - t.log_ratio).sum() / n),
                 "log_ratio_mean": float(t.log_ratio.sum() / n),
                 "log_ratio_max": float(t.log_ratio.abs().max()) if logprobs.numel() else 0.0,
                 "masked_frac": float((1 - t.mask).sum() / n),
                 "kl_penalty": float(t.kl.sum() / n)}
    return loss, stats
