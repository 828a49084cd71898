"""The trajectory processor: ended runs → capped, count-once, packed training batch.

    runs ─► validate ─► assemble (per run) ─► select ≤ K ─► prefix tree ─► count-once weights
         ─► group advantages ─► pack (tree | per_trajectory) ─► TrajectoryBatch(stats, ...)

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

import numpy as np

from ray_xlong.trajectory.advantages import group_advantages
from ray_xlong.trajectory.assembly import Trajectory, assemble
from ray_xlong.trajectory.packing import PackedBatch, RunPiece, pack
from ray_xlong.trajectory.records import AgentRun, RecordError, check_run
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
    vocab_size: int | None = None
    """When set, a run holding an id ``>= vocab_size`` is malformed (None: not checked)."""
    on_malformed_run: Literal["raise", "skip"] = "raise"
    """``raise``: a malformed run raises :class:`RecordError`; ``skip``: it is left out of the
    batch (and its group's baseline) and counted in ``stats.runs_malformed``."""

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
        v = self.vocab_size
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise ValueError(f"ProcessorConfig.vocab_size must be None or an int >= 1, got {v!r}")
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
        _check_runs(runs)
        assembled, malformed = self._checked(runs)
        trained = [r for r in runs if r.status != "failed" and r.run_id not in malformed]
        advantages = group_advantages(trained, normalize_std=self.config.normalize_std)
        pieces, kept_all, dropped_all = [], [], []
        for run in trained:
            kept, dropped = select(assembled[run.run_id], self.config.max_trajectories_per_run)
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
        failed = tuple(r.run_id for r in runs if r.status == "failed"
                       and r.run_id not in malformed)
        stats = dataclasses.replace(_stats(pieces, dropped_all, failed),
                                    runs_malformed=len(malformed))
        return TrajectoryBatch(tuple(kept_all), tuple(dropped_all),
                               {p.run.run_id: p.tree for p in pieces}, advantages, failed,
                               packed, stats, malformed)

    def _checked(self, runs: Sequence[AgentRun]) -> tuple[dict[str, list[Trajectory]],
                                                           dict[str, str]]:
        """Check every run; assemble the trained ones. Returns (run id → trajectories,
        run id → error of each skipped malformed run); raises in ``raise`` mode."""
        assembled: dict[str, list[Trajectory]] = {}
        malformed: dict[str, str] = {}
        for run in runs:
            try:
                check_run(run, vocab_size=self.config.vocab_size, scan_inputs=False)
                if run.status != "failed":
                    assembled[run.run_id] = assemble(run)
                    _check_trajectory_ids(run, assembled[run.run_id], self.config.vocab_size)
            except RecordError as exc:
                if self.config.on_malformed_run == "raise":
                    raise
                assembled.pop(run.run_id, None)
                malformed[run.run_id] = str(exc)
        return assembled, malformed


def _check_runs(runs: Sequence[AgentRun]) -> None:
    seen: set[str] = set()
    for i, run in enumerate(runs):
        if not isinstance(run, AgentRun):
            raise RecordError(f"runs[{i}] is a {type(run).__name__}, not an AgentRun")
        if run.run_id in seen:
            raise RecordError(f"run {run.run_id!r}: run_id is duplicated in the batch")
        seen.add(run.run_id)


def _check_trajectory_ids(run: AgentRun, trajectories: list[Trajectory],
                          vocab_size: int | None) -> None:
    """Range-check the ids of a run's trajectories (they hold every input and output id); on a
    bad id, find and name the call (``check_run`` with every input scanned)."""
    hi_ok = vocab_size if vocab_size is not None else np.iinfo(np.int64).max
    for t in trajectories:
        ids = t.token_ids
        if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= hi_ok):
            check_run(run, vocab_size=vocab_size, scan_inputs=True)
            raise RecordError(f"run {run.run_id!r}: trajectory {t.index} (agent "
                              f"{t.agent_id!r}) holds an id outside [0, {hi_ok})")


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
