"""The trajectory processor: ended runs → capped, count-once, packed training batch.

    runs ─► validate ─► assemble (per run) ─► select ≤ K ─► prefix tree ─► count-once weights
         ─► group advantages ─► pack (tree | per_trajectory) ─► TrajectoryBatch(stats, ...)

The per-run part is ``per_run.process_run`` (what a rollout cell runs on each run as it ends);
``process`` strings it together with the group advantages and the packer.

Usable alone (no Ray)::

    from ray_xlong.trajectory import ModelCall, AgentRun, TrajectoryProcessor, ProcessorConfig
    batch = TrajectoryProcessor(ProcessorConfig(max_trajectories_per_run=5, pack="tree")).process(runs)

``failed`` runs are validated, reported (``stats.runs_failed``, ``failed_run_ids``) and neither
trained nor part of their group's baseline (see ``advantages.py``); ``timeout`` runs are trained
like finished ones with their partial reward.

Malformed runs: every run is checked again (``records.check_run``: it may come unpickled from
another process, where construction checks did not run), and every assembled trajectory's ids are
range-checked (they hold every input id, so this costs O(trajectory tokens), not O(Σ inputs)).
A bad run raises :class:`RecordError` naming the run, call and field — or, with
``on_malformed_run="skip"``, is left out like a failed run and reported (``stats.runs_malformed``,
``malformed``: run id → the error). Never silently.
"""

from __future__ import annotations

import dataclasses
from typing import Literal, Sequence


from ray_xlong.checks import check_int
from ray_xlong.trajectory.advantages import group_advantages
from ray_xlong.trajectory.assembly import Trajectory
from ray_xlong.trajectory.packing import PackedBatch, RunPiece, pack
from ray_xlong.trajectory.records import AgentRun, RecordError
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
    malformed: dict[str, str] = dataclasses.field(default_factory=dict)
    """Runs left out as malformed (``on_malformed_run="skip"``): run id → the error."""

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
        from ray_xlong.trajectory.per_run import process_run  # per_run builds on this module

        _check_runs(runs)
        done = [process_run(run, self.config) for run in runs]
        malformed = {p.digest.run_id: p.digest.malformed for p in done if p.digest.malformed}
        trained = [p for p in done if p.piece is not None]
        advantages = group_advantages([p.digest for p in trained],
                                      normalize_std=self.config.normalize_std)
        pieces = [dataclasses.replace(p.piece, advantage=advantages[p.digest.run_id])
                  for p in trained]
        dropped_all = [t for p in trained for t in p.dropped]
        packed = None
        if self.config.pack != "none":
            packed = pack(pieces, layout=self.config.pack, loss_norm=self.config.loss_norm,
                          row_tokens=self.config.row_tokens,
                          pad_token_id=self.config.pad_token_id)
        failed = tuple(r.run_id for r in runs if r.status == "failed"
                       and r.run_id not in malformed)
        stats = dataclasses.replace(run_stats(pieces, dropped_all, failed),
                                    runs_malformed=len(malformed))
        return TrajectoryBatch(tuple(t for p in pieces for t in p.kept), tuple(dropped_all),
                               {p.run.run_id: p.tree for p in pieces}, advantages, failed,
                               packed, stats, malformed)


def _check_runs(runs: Sequence[AgentRun]) -> None:
    seen: set[str] = set()
    for i, run in enumerate(runs):
        if not isinstance(run, AgentRun):
            raise RecordError(f"runs[{i}] is a {type(run).__name__}, not an AgentRun")
        if run.run_id in seen:
            raise RecordError(f"run {run.run_id!r}: run_id is duplicated in the batch")
        seen.add(run.run_id)


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
