"""What the trajectory processor is configured by (:class:`ProcessorConfig`) and what it counts
over a batch (:class:`BatchStats`, :func:`run_stats`).

Shared by the whole-batch processor (``processor.py``) and the per-run split (``per_run.py``),
which both build on this module.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from ray_xlong.checks import check_int
from ray_xlong.trajectory.assembly import Trajectory
from ray_xlong.trajectory.packing import RunPiece

PackMode = Literal["tree", "per_trajectory", "none"]


@dataclasses.dataclass(frozen=True, slots=True)
class ProcessorConfig:
    """Configuration of :class:`TrajectoryProcessor`; validated at construction."""

    max_trajectories_per_run: int = 5
    """K: trajectories kept per run (ranked main > summaries > subagents)."""
    pack: PackMode = "tree"
    """``tree`` (one sequence per run's tree), ``per_trajectory`` (a row per trajectory) or
    ``none`` (trajectories, trees and stats only)."""
    normalize_std: bool = False
    """Divide group advantages by the group's reward std."""
    loss_norm: Literal["token", "run"] = "token"
    """``token``: Σ weighted token losses ÷ unique trainable tokens of the batch (default);
    ``run``: mean over runs of each run's mean token loss."""
    row_tokens: int | None = 4096
    """Tree layout: token budget per row (a bigger run gets its own row; None = a row per run)."""
    pad_token_id: int = 0
    """Id written into padding."""
    vocab_size: int | None = None
    """When set, a run holding an id ``>= vocab_size`` is malformed (None: not checked)."""
    on_malformed_run: Literal["raise", "skip"] = "raise"
    """``raise``: a malformed run raises :class:`RecordError`; ``skip``: it is left out of the
    batch (and its group's baseline) and counted in ``stats.runs_malformed``."""

    def __post_init__(self) -> None:
        check_int("ProcessorConfig", "max_trajectories_per_run", self.max_trajectories_per_run,
                  minimum=1)
        if self.pack not in ("tree", "per_trajectory", "none"):
            raise ValueError(f"ProcessorConfig.pack must be 'tree', 'per_trajectory' or 'none', "
                             f"got {self.pack!r}")
        if self.loss_norm not in ("token", "run"):
            raise ValueError(f"ProcessorConfig.loss_norm must be 'token' or 'run', "
                             f"got {self.loss_norm!r}")
        if self.row_tokens is not None and (not isinstance(self.row_tokens, int)
                                            or self.row_tokens < 1):
            raise ValueError(f"ProcessorConfig.row_tokens must be None or an int >= 1, "
                             f"got {self.row_tokens!r}")
        if not isinstance(self.pad_token_id, int) or self.pad_token_id < 0:
            raise ValueError(f"ProcessorConfig.pad_token_id must be an int >= 0, "
                             f"got {self.pad_token_id!r}")
        v = self.vocab_size
        check_int("ProcessorConfig", "vocab_size", v, minimum=1, allow_none=True)
        if v is not None and self.pad_token_id >= v:
            raise ValueError(f"ProcessorConfig.pad_token_id ({self.pad_token_id}) must be < "
                             f"vocab_size ({v})")
        if self.on_malformed_run not in ("raise", "skip"):
            raise ValueError(f"ProcessorConfig.on_malformed_run must be 'raise' or 'skip', "
                             f"got {self.on_malformed_run!r}")


@dataclasses.dataclass(frozen=True, slots=True)
class BatchStats:
    """Counts over the trained (non-failed) runs of a batch."""

    runs: int
    """Runs trained (finished + timeout)."""
    runs_timeout: int
    """Of those, runs that timed out (trained on partial work)."""
    runs_failed: int
    """Runs excluded because they failed."""
    trajectories_kept: int
    """Σ over runs of kept trajectories (≤ K each)."""
    trajectories_dropped: int
    """Σ over runs of trajectories dropped by the cap."""
    total_tokens: int
    """Σ over kept trajectories of their length (what per-trajectory training computes)."""
    unique_tokens: int
    """Σ over runs of prefix-tree tokens (what tree training computes)."""
    trainable_tokens: int
    """Unique trainable tokens: model-generated tree tokens, each counted once per run."""
    weighted_trainable_tokens: float
    """Σ of kept trajectories' loss weights (= ``trainable_tokens`` by count-once)."""
    trajectory_trainable_tokens: int
    """Σ over kept trajectories of tokens trainable in them (shared ones counted per path)."""
    runs_malformed: int = 0
    """Runs left out because they were malformed (``on_malformed_run="skip"``)."""

    @property
    def dedup_ratio(self) -> float:
        """``total_tokens / unique_tokens``: the bound on tree-training speedup."""
        return self.total_tokens / max(self.unique_tokens, 1)


def run_stats(pieces: list[RunPiece], dropped: list[Trajectory],
              failed: tuple[str, ...]) -> BatchStats:
    """Counts over trained runs (their pieces), the dropped trajectories and failed run ids."""
    kept = [t for p in pieces for t in p.kept]
    return BatchStats(
        runs=len(pieces),
        runs_timeout=sum(p.run.status == "timeout" for p in pieces),
        runs_failed=len(failed),
        trajectories_kept=len(kept),
        trajectories_dropped=len(dropped),
        total_tokens=sum(t.num_tokens for t in kept),
        unique_tokens=sum(p.tree.num_tokens for p in pieces),
        trainable_tokens=sum(p.tree.num_trainable for p in pieces),
        weighted_trainable_tokens=float(sum(t.loss_weights.sum(dtype="float64") for t in kept)),
        trajectory_trainable_tokens=sum(
            int(sum(p.tree.trainable_mask(i, t.num_tokens, owned_only=False).sum()
                    for i, t in enumerate(p.kept)))
            for p in pieces),
    )
