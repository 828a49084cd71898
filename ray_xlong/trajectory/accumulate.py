"""Accumulate one micro-batch's loss: the training step every trainer shares.

The Learner on a cell (``rllib/learner.py``), the single-process loop (``benchmarks/tools/local_rl.py``)
and the step benchmark all train the same way::

    logprobs = token_logprobs(model, micro)            either layout; tree rows use the
                                                       model's attention (``xlong_tree``: no
                                                       dense mask)
    loss, stats = policy_loss(logprobs, micro, config) Σ loss_scale · ℓ (count-once weights)
    loss.backward()                                    adds into ``p.grad``; no optimizer step

``loss_scale`` already carries the normalizer, so the micro-batches of one batch add up to the
batch's loss: callers sum gradients, then step once.
"""

from __future__ import annotations

import dataclasses

import torch

from ray_xlong.trajectory.loss import LossConfig, policy_loss
from ray_xlong.trajectory.loss_stats import LossStats, loss_stats
from ray_xlong.trajectory.model import token_logprobs
from ray_xlong.trajectory.packing import PackedBatch


@dataclasses.dataclass(frozen=True, slots=True)
class MicroBatchLoss:
    """What one accumulated micro-batch contributed."""

    loss: float
    """Its loss value ``Σ loss_scale · ℓ`` (detached)."""
    targets: int
    """Target tokens it trained (0: nothing was computed)."""
    ratio_mean: float
    """Mean importance ratio over its targets."""
    clip_frac: float
    """Share of its targets whose ratio was clipped."""
    stats: LossStats = LossStats()
    """The loss diagnostics (ratio min / mean / max, clip count, approx KL, entropy estimate)
    as sums that merge over micro-batches and cells."""


def accumulate_loss(model: torch.nn.Module, micro: PackedBatch, *,
                    config: LossConfig = LossConfig(),
                    reference: torch.nn.Module | None = None) -> MicroBatchLoss:
    """Forward and backward one micro-batch, adding ``∇ loss`` into the parameters' ``.grad``.

    Args:
        model: a HF causal LM (its ``_attn_implementation`` decides how tree rows attend).
        micro: one packed micro-batch (``PackedBatch``; ``PackedBatch.from_tensors`` for the
            tensor form).
        config: the loss form (PPO clip / truncated IS, corrections, KL penalty).
        reference: the frozen reference policy (required when ``config.needs_reference``:
            its logprobs of the targets, without gradient, enter the KL penalty).

    Returns:
        :class:`MicroBatchLoss` (an empty micro-batch computes nothing and returns zeros).
    """
    n = micro.num_targets
    if n == 0:
        return MicroBatchLoss(0.0, 0, 0.0, 0.0)
    ref = None
    if config.needs_reference:
        if reference is None:
            raise ValueError("accumulate_loss: LossConfig.kl_reference='reference' needs a "
                             "reference model")
        with torch.no_grad():
            ref = token_logprobs(reference, micro)
    logprobs = token_logprobs(model, micro)
    loss, stats = policy_loss(logprobs, micro, config, ref_logprobs=ref)
    loss.backward()
    value = float(loss.detach())
    return MicroBatchLoss(value, n, stats["ratio_mean"], stats["clip_frac"],
                          loss_stats(logprobs, micro, config, loss=value, ref_logprobs=ref))
