"""The trajectory processor: ended runs → capped, count-once, packed training batch.

    runs ─► validate ─► assemble (per run) ─► select ≤ K ─► prefix tree ─► count-once weights
         ─► group advantages ─► pack (tree | per_trajectory) ─► TrajectoryBatch(stats, ...)

Usable alone (no Ray)::

    from ray_xlong.trajectory import ModelCall, AgentRun, TrajectoryProcessor, ProcessorConfig
    batch = TrajectoryProcessor(ProcessorConfig(max_trajectories_per_run=5, pack="tree")).process(runs)

``failed`` runs are validated, reported (``stats.runs_failed``, ``failed_run_ids``) and neither
trained nor part of their group's baseline (see ``advantages.py``); ``timeout`` runs are trained
like finished ones with their partial reward.
"""

from __future__ import annotations

import dataclasses
from typing import Literal, Sequence

from ray_xlong.trajectory.advantages import group_advantages
from ray_xlong.trajectory.assembly import Trajectory, assemble
from ray_xlong.trajectory.packing import PackedBatch, RunPiece, pack
from ray_xlong.trajectory.records import AgentRun, RecordError
from ray_xlong.trajectory.selection import select
from ray_xlong.trajectory.tree import PrefixTree

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

    def __post_init__(self) -> None:
        k = self.max_trajectories_per_run
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"ProcessorConfig.max_trajectories_per_run must be an int >= 1, "
                             f"got {k!r}")
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

    @property
    def dedup_ratio(self) -> float:
        """``total_tokens / unique_tokens``: the bound on tree-training speedup."""
        return self.total_tokens / max(self.unique_tokens, 1)


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class TrajectoryBatch:
    """The processor's output."""

    trajectories: tuple[Trajectory, ...]
    """Kept trajectories of trained runs (run order, then kept order), with ``loss_weights``."""
    dropped: tuple[Trajectory, ...]
    """Trajectories dropped by the cap (without weights)."""
    trees: dict[str, PrefixTree]
    """Prefix tree of each trained run, by run id."""
    advantages: dict[str, float]
    """Advantage of each trained run, by run id."""
    failed_run_ids: tuple[str, ...]
    """Runs excluded because they failed."""
    packed: PackedBatch | None
    """Tensors for training (None when ``pack="none"``)."""
    stats: BatchStats
    """Counts (see :class:`BatchStats`)."""

    def __repr__(self) -> str:
        s = self.stats
        return (f"TrajectoryBatch(runs={s.runs}, kept={s.trajectories_kept}, "
                f"dropped={s.trajectories_dropped}, total_tokens={s.total_tokens}, "
                f"unique_tokens={s.unique_tokens}, trainable={s.trainable_tokens}, "
                f"packed={self.packed!r})")


class TrajectoryProcessor:
    """Turns ended runs into a training batch (see module docstring)."""

    def __init__(self, config: ProcessorConfig = ProcessorConfig()) -> None:
        if not isinstance(config, ProcessorConfig):
            raise TypeError(f"config must be a ProcessorConfig, got {type(config).__name__}")
        self.config = config

    def process(self, runs: Sequence[AgentRun]) -> TrajectoryBatch:
        """Process ended runs into one batch.

        Args:
            runs: ended runs (any groups); run ids must be unique.

        Returns:
            The batch: kept trajectories with count-once weights, trees, advantages, packed
            tensors and stats.
        """
        _check_runs(runs)
        trained = [r for r in runs if r.status != "failed"]
        advantages = group_advantages(trained, normalize_std=self.config.normalize_std)
        pieces, kept_all, dropped_all = [], [], []
        for run in trained:
            kept, dropped = select(assemble(run), self.config.max_trajectories_per_run)
            tree = PrefixTree.build(run.run_id, kept, dropped)
            kept = [dataclasses.replace(t, loss_weights=tree.loss_weights(i, t.num_tokens))
                    for i, t in enumerate(kept)]
            pieces.append(RunPiece(run, kept, tree, advantages[run.run_id]))
            kept_all.extend(kept)
            dropped_all.extend(dropped)
        packed = None
        if self.config.pack != "none":
            packed = pack(pieces, layout=self.config.pack, loss_norm=self.config.loss_norm,
                          row_tokens=self.config.row_tokens,
                          pad_token_id=self.config.pad_token_id)
        failed = tuple(r.run_id for r in runs if r.status == "failed")
        stats = _stats(pieces, dropped_all, failed)
        return TrajectoryBatch(tuple(kept_all), tuple(dropped_all),
                               {p.run.run_id: p.tree for p in pieces}, advantages, failed,
                               packed, stats)


def _check_runs(runs: Sequence[AgentRun]) -> None:
    seen: set[str] = set()
    for i, run in enumerate(runs):
        if not isinstance(run, AgentRun):
            raise RecordError(f"runs[{i}] is a {type(run).__name__}, not an AgentRun")
        if run.run_id in seen:
            raise RecordError(f"run {run.run_id!r}: run_id is duplicated in the batch")
        seen.add(run.run_id)


def _stats(pieces: list[RunPiece], dropped: list[Trajectory], failed: tuple[str, ...]):
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
