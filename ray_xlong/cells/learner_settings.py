"""``LearnerSettings``: what a cell's Learner trains and how (model, lr, loss, dtype, micro-batch
budget, clipping, attention, context parallelism), validated at construction with errors that
name the field. Imports nothing of the cell runtime, so the pool, the sharded ranks and the job
config (``config.py``) all build on it.
"""

from __future__ import annotations

import dataclasses

import torch

from ray_xlong.checks import check_int
from ray_xlong.trajectory import LossConfig

ATTENTIONS = ("xlong_tree", "sdpa", "eager", "flex_attention")
"""``LearnerSettings.attn_implementation`` values."""

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}
"""``LearnerSettings.dtype`` names."""


@dataclasses.dataclass(frozen=True, slots=True)
class LearnerSettings:
    """What a cell's Learner trains and how."""

    model_dir: str
    """Model directory (``ray_xlong.models.build_tiny_model_dir``); engines load the same."""
    lr: float = 1e-4
    """Adam learning rate."""
    loss: LossConfig = LossConfig()
    """Token loss form (PPO clip / truncated IS)."""
    dtype: str = "float32"
    """Training dtype: one of :data:`DTYPES`."""
    micro_batch_tokens: int = 4096
    """Token budget of one micro-batch (rows × width)."""
    grad_clip: float | None = None
    """Global-norm clip of the reduced gradient before the optimizer step (None: no clip)."""
    attn_implementation: str | None = None
    """How the Learner's model attends: one of :data:`ATTENTIONS`, or None (default) for "by
    batch layout": ``xlong_tree`` on tree batches (segments, no dense mask) and HF ``sdpa`` on
    per-trajectory rows (the ``xlong_tree`` implementation runs sdpa when a batch has no tree
    plan, so one model serves both). ``sdpa`` / ``eager`` train tree batches with dense masks
    (a reference); ``flex_attention`` is the GPU path."""
    context_parallel: int = 1
    """Ranks per tree row (context parallelism, ``cells/context_parallel.py``): a sharded cell
    of N ranks runs N ÷ context_parallel data-parallel groups, each splitting its rows by token
    ranges. Must divide ``ShardingSettings.ranks_per_cell``; needs tree packing and a token-level
    loss (``LossConfig.ratio_level='token'``, no ``sequence_mask``)."""

    def __post_init__(self) -> None:
        if not isinstance(self.model_dir, str) or not self.model_dir:
            raise ValueError(f"LearnerSettings.model_dir must be a path string, "
                             f"got {self.model_dir!r}")
        if not self.lr > 0:
            raise ValueError(f"LearnerSettings.lr must be > 0, got {self.lr!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"LearnerSettings.dtype must be one of {sorted(DTYPES)}, "
                             f"got {self.dtype!r}")
        if self.grad_clip is not None and not self.grad_clip > 0:
            raise ValueError(f"LearnerSettings.grad_clip must be > 0 or None, "
                             f"got {self.grad_clip!r}")
        if self.attn_implementation is not None and self.attn_implementation not in ATTENTIONS:
            raise ValueError(f"LearnerSettings.attn_implementation must be one of {ATTENTIONS} "
                             f"or None, got {self.attn_implementation!r}")
        check_int("LearnerSettings", "context_parallel", self.context_parallel, minimum=1)
        if self.context_parallel > 1 and (self.loss.ratio_level != "token"
                                          or self.loss.sequence_mask is not None):
            # a run's targets are split across the row's ranks: a per-run quantity would be
            # each rank's partial one
            raise ValueError(f"LearnerSettings.context_parallel={self.context_parallel} splits "
                             f"each run's targets across ranks; LossConfig.ratio_level="
                             f"{self.loss.ratio_level!r} and sequence_mask="
                             f"{self.loss.sequence_mask!r} need a run's targets on one rank "
                             f"(ratio_level='token', sequence_mask=None)")
        if self.micro_batch_tokens < 1:
            raise ValueError(f"LearnerSettings.micro_batch_tokens must be >= 1, "
                             f"got {self.micro_batch_tokens!r}")

    @property
    def model_attention(self) -> str:
        """The ``attn_implementation`` the Learner loads its model with (None → ``xlong_tree``,
        which is sdpa on per-trajectory batches)."""
        return self.attn_implementation or "xlong_tree"
