"""The processor split where the data lives: a run is processed where it ended, the driver sees a
small digest, the training cell packs the runs of its micro-batch.

```
rollout cell, per run as it ends   process_run(run, config) ─► ProcessedRun
                                     check → assemble → select ≤ K → prefix tree → count-once
                                     .digest: RunDigest (reward, status, counts: a few numbers)
driver, per step (digests only)     group_advantages(digests)            whole groups
                                    plan_micro_batches(digests, budget)  runs → micro-batches
                                    normalizer(digests, loss_norm)       Σ over the step
training cell, per micro-batch      pack_runs(processed, advantages, config) ─► PackedBatch
                                     loss_scale un-normalised: Σ_micro loss ÷ Σ normalizer
                                     equals the loss of the whole batch processed at once
```

``TrajectoryProcessor.process`` is the same pipeline in one place (``process_run`` per run, then
advantages and ``pack``), so both paths share every step.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Sequence

import numpy as np

from ray_xlong.trajectory.assembly import Trajectory, assemble
from ray_xlong.trajectory.packing import PackedBatch, RunPiece, pack
from ray_xlong.trajectory.batch_config import BatchStats, ProcessorConfig, run_stats
from ray_xlong.trajectory.records import AgentRun, RecordError, check_run
from ray_xlong.trajectory.selection import select
from ray_xlong.trajectory.tree import PrefixTree


@dataclasses.dataclass(frozen=True, slots=True)
class RunDigest:
    """What the driver needs of an ended run: a few numbers, no tokens."""

    run_id: str
    """The run."""
    group_id: str
    """Its group (advantages are per group)."""
    status: str
    """``finished`` | ``timeout`` | ``failed``."""
    reward: float
    """Its reward."""
    stats: BatchStats
    """Its processor counts (one run)."""
    targets: int
    """Unique trainable tokens (loss targets) it contributes."""
    tokens: int
    """Tokens it puts into a micro-batch: tree tokens (``tree``) or Σ trajectory tokens."""
    min_version: int
    """Oldest policy version among its targets (-1: no targets)."""
    malformed: str | None = None
    """The error when the run was left out as malformed (``on_malformed_run="skip"``)."""
    agent: object | None = None
    """What the agent did (``rollout.run_stats.RunStats``: turns, tool calls, stop reason, …),
    attached where the run ended by whoever ran the agent; None when not known. Opaque here:
    the processor neither reads nor needs it."""


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class ProcessedRun:
    """One run after :func:`process_run`: ready to pack once its advantage is known."""

    digest: RunDigest
    """The small part (see :class:`RunDigest`)."""
    piece: RunPiece | None
    """Kept trajectories (count-once weights), tree and the run (advantage 0 until packed);
    None for a failed or malformed run (nothing to train)."""
    dropped: tuple[Trajectory, ...] = ()
    """Trajectories the K cap dropped."""


def process_run(run: AgentRun, config: ProcessorConfig = ProcessorConfig()) -> ProcessedRun:
    """Check, assemble, cap, build the prefix tree and count-once weights of one ended run.

    Raises:
        RecordError: the run is malformed (names the run / call / field), unless
            ``config.on_malformed_run == "skip"`` (then the digest carries the error).
    """
    if not isinstance(run, AgentRun):
        raise RecordError(f"process_run: expected an AgentRun, got {type(run).__name__}")
    try:
        check_run(run, vocab_size=config.vocab_size, scan_inputs=False)
        trajectories = assemble(run) if run.status != "failed" else []
        _check_trajectory_ids(run, trajectories, config.vocab_size)
    except RecordError as exc:
        if config.on_malformed_run == "raise":
            raise
        return ProcessedRun(_digest(run, None, (), config, malformed=str(exc)), None)
    if run.status == "failed":
        return ProcessedRun(_digest(run, None, (), config), None)
    kept, dropped = select(trajectories, config.max_trajectories_per_run)
    tree = PrefixTree.build(run.run_id, kept, dropped)
    kept = [dataclasses.replace(t, loss_weights=tree.loss_weights(i, t.num_tokens))
            for i, t in enumerate(kept)]
    piece = RunPiece(run, kept, tree, 0.0)
    return ProcessedRun(_digest(run, piece, tuple(dropped), config), piece, tuple(dropped))


def _digest(run: AgentRun, piece: RunPiece | None, dropped: tuple[Trajectory, ...],
            config: ProcessorConfig, *, malformed: str | None = None) -> RunDigest:
    failed = () if malformed or run.status != "failed" else (run.run_id,)
    stats = run_stats([piece] if piece else [], list(dropped), failed)
    if malformed:
        stats = dataclasses.replace(stats, runs_malformed=1)
    versions = [c.policy_version for c in run.calls] if piece else []
    tokens = stats.unique_tokens if config.pack == "tree" else stats.total_tokens
    return RunDigest(run.run_id, run.group_id, run.status, float(run.reward), stats,
                     stats.trainable_tokens, tokens, min(versions, default=-1), malformed)


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


def pack_runs(runs: Sequence[ProcessedRun], advantages: Mapping[str, float], *,
              config: ProcessorConfig, normalize: bool = False) -> PackedBatch:
    """Pack processed runs with their (group-wide) advantages.

    Args:
        runs: processed runs (failed / malformed ones are skipped).
        advantages: run id → advantage, computed over whole groups (``group_advantages``).
        config: layout, loss normalisation, row budget, padding.
        normalize: False (default): un-normalised ``loss_scale`` (divide the summed loss by
            :func:`normalizer` of the step); True: normalised over these runs alone.

    Raises:
        KeyError: a trainable run has no advantage (names the run).
    """
    pieces = []
    for r in runs:
        if r.piece is None:
            continue
        if r.digest.run_id not in advantages:
            raise KeyError(f"pack_runs.advantages: no advantage for run {r.digest.run_id!r}")
        pieces.append(dataclasses.replace(r.piece, advantage=float(advantages[r.digest.run_id])))
    return pack(pieces, layout=config.pack, loss_norm=config.loss_norm,
                row_tokens=config.row_tokens, pad_token_id=config.pad_token_id,
                normalize=normalize)


def normalizer(digests: Sequence[RunDigest], loss_norm: str) -> float:
    """What the un-normalised losses of these runs are divided by: Σ targets (``token``) or
    the runs that have targets (``run``); at least 1."""
    if loss_norm == "token":
        return float(max(sum(d.targets for d in digests), 1))
    return float(max(sum(1 for d in digests if d.targets), 1))


def plan_micro_batches(digests: Sequence[RunDigest], *, max_tokens: int) -> list[tuple[str, ...]]:
    """Split trainable runs into micro-batches of whole runs, in order, each at most
    ``max_tokens`` tokens (a bigger run goes alone). Runs without targets are left out."""
    plan: list[list[str]] = []
    used = 0
    for d in digests:
        if not d.targets:
            continue
        if not plan or used + d.tokens > max_tokens:
            plan.append([])
            used = 0
        plan[-1].append(d.run_id)
        used += d.tokens
    return [tuple(p) for p in plan]


def merge_stats(stats: Sequence[BatchStats]) -> BatchStats:
    """Field-wise sum of per-run (or per-batch) counts."""
    names = [f.name for f in dataclasses.fields(BatchStats)]
    return BatchStats(**{n: sum(getattr(s, n) for s in stats) for n in names})
