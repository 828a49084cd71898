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
from typing import Sequence

from ray_xlong.trajectory.advantages import group_advantages
from ray_xlong.trajectory.assembly import Trajectory
from ray_xlong.trajectory.batch_config import BatchStats, PackMode, ProcessorConfig, run_stats
from ray_xlong.trajectory.packing import PackedBatch, pack
from ray_xlong.trajectory.per_run import process_run
from ray_xlong.trajectory.records import AgentRun, RecordError
from ray_xlong.trajectory.tree import PrefixTree

__all__ = ["BatchStats", "PackMode", "ProcessorConfig", "TrajectoryBatch", "TrajectoryProcessor",
           "run_stats"]

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
