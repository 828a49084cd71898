"""``PrefixTreeConnector``: the trajectory processor as an RLlib learner connector piece.

A thin adapter (RLlib 2.60, new API stack). Per learner update it reads the ended runs off the
episodes (see ``episodes.py``), runs :class:`TrajectoryProcessor` once per RLModule and writes the
packed tensors into the train batch::

    episodes ─► runs_by_module ─► TrajectoryProcessor(config).process(runs) ─► batch[module_id]
                                                      └─► metrics[(module_id, "xlong/...")]

Batch format — ``batch[module_id]`` is a plain dict (``R`` rows, ``L`` columns, ``T`` targets;
fields as in :class:`ray_xlong.trajectory.PackedBatch`, all CPU torch tensors)::

    input_ids [R, L] int64   position_ids [R, L] int64   attention_mask [R, L] int64
    valid [R, L] bool        target_row [T] int64        target_src [T] int64
    target_ids [T] int64     behaviour_logprobs [T] f32  policy_versions [T] int64
    advantages [T] f32       loss_scale [T] f32          target_run [T] int64
    layout [1] int64         0 = tree, 1 = per_trajectory (LAYOUT_CODES)
    run_ids [n] uint8        the trained run ids, UTF-8 JSON list (decode: packed_from_batch)

Only tensors, so that RLlib may move, pickle or tensor-convert the batch (its ``NumpyToTensor``
and ``Learner._convert_batch_type`` reject strings).

:func:`packed_from_batch` turns it back into a ``PackedBatch`` for
``ray_xlong.trajectory.model.token_logprobs`` and ``ray_xlong.trajectory.loss.policy_loss``.
Rows and targets are not parallel (``R`` ≠ ``T``), so the Learner must not slice this batch into
RLlib minibatches (``minibatch_size=None``); ``loss_scale`` makes the loss of micro-batches add.

Metrics — per module, ``metrics.log_value((module_id, key), value, reduce="sum")`` for every
key of :data:`METRIC_KEYS` (counts summed over the updates of a reporting period), and
``(module_id, "xlong/dedup_ratio")`` with ``reduce="mean"``.

Config — the piece builds the complete module batch (tensors already), so RLlib's default
learner pieces are neither needed nor wanted: set
``config.learners(learner_connector=lambda obs, act: PrefixTreeConnector(config=...),
add_default_connectors_to_learner_pipeline=False)``. With the defaults on they run *after* this
piece and add placeholder ``obs`` / ``actions`` / ``rewards`` … columns next to ours (harmless
to :func:`packed_from_batch`, but wasted work; PPO's GAE piece would also need a value head).

A module whose runs all failed still gets a module batch (zero targets; the failures are in the
metrics).

Invariants: nothing is dropped silently (an episode without a run, a malformed run, a module id
already in the batch raise, naming the episode / run / module; with
``ProcessorConfig(on_malformed_run="skip")`` a malformed run is left out, counted in
``xlong/runs_malformed`` and logged as a warning with its error); the tensors equal those of
``TrajectoryProcessor(config).process(runs)`` run directly on the same runs.
"""

from __future__ import annotations

import logging
from typing import Any, Mapping

import gymnasium as gym
import torch
from ray.rllib.connectors.connector_v2 import ConnectorV2
from ray.rllib.utils.metrics.metrics_logger import MetricsLogger

from ray_xlong.rllib.episodes import processed_by_run, runs_by_module
from ray_xlong.trajectory import BatchStats, PackedBatch, ProcessorConfig, TrajectoryProcessor
from ray_xlong.trajectory.packing import LAYOUT_CODES, TENSOR_KEYS  # noqa: F401 (re-exported)
from ray_xlong.trajectory.per_run import merge_stats, pack_runs, process_run

logger = logging.getLogger(__name__)

METRIC_KEYS: dict[str, str] = {
    "runs": "xlong/runs",
    "runs_timeout": "xlong/runs_timeout",
    "runs_failed": "xlong/runs_failed",
    "runs_malformed": "xlong/runs_malformed",
    "trajectories_kept": "xlong/trajectories_kept",
    "trajectories_dropped": "xlong/trajectories_dropped",
    "total_tokens": "xlong/total_tokens",
    "unique_tokens": "xlong/unique_tokens",
    "trainable_tokens": "xlong/trainable_tokens",
    "weighted_trainable_tokens": "xlong/weighted_trainable_tokens",
    "trajectory_trainable_tokens": "xlong/trajectory_trainable_tokens",
    "num_targets": "xlong/num_targets",
    "num_positions": "xlong/num_positions",
}
"""``BatchStats`` field (plus ``num_targets`` / ``num_positions`` of the packed batch) → metric
key under the module id; logged with ``reduce="sum"``."""

ADVANTAGES_KEY = "xlong_advantages"
"""``shared_data[ADVANTAGES_KEY]``: run id → advantage, set by the elastic step on a training
cell (advantages are per group, a micro-batch may hold part of one). With it the piece packs the
runs with those advantages and *un-normalised* ``loss_scale`` (the step divides by its total),
reusing each run's ``ProcessedRun`` when the episode carries one (``episodes.PROCESSED_KEY``)."""

DEDUP_RATIO_KEY = "xlong/dedup_ratio"
"""``total_tokens / unique_tokens`` of the update (the tree-training speedup bound), mean."""


class PrefixTreeConnector(ConnectorV2):
    """Learner connector piece: episodes carrying ended runs → packed prefix-tree batches."""

    def __init__(self, input_observation_space: gym.Space | None = None,
                 input_action_space: gym.Space | None = None, *,
                 config: ProcessorConfig = ProcessorConfig(), **kwargs: Any) -> None:
        """Args:
            input_observation_space: RLlib's pipeline argument (unused: runs carry tokens).
            input_action_space: RLlib's pipeline argument (unused).
            config: the processor's configuration; ``pack`` must be ``tree`` or
                ``per_trajectory`` (a learner needs tensors).
            **kwargs: RLlib's forward-compatibility arguments of ``ConnectorV2`` (the one
                ``**kwargs`` this package passes on: RLlib's constructor contract requires it).
        """
        super().__init__(input_observation_space, input_action_space, **kwargs)
        if not isinstance(config, ProcessorConfig):
            raise TypeError(f"PrefixTreeConnector.config must be a ProcessorConfig, "
                            f"got {type(config).__name__}")
        if config.pack == "none":
            raise ValueError("PrefixTreeConnector.config.pack must be 'tree' or "
                             "'per_trajectory' (a learner needs packed tensors), got 'none'")
        self.config = config
        self._processor = TrajectoryProcessor(config)

    def __call__(self, *, rl_module: Any, batch: dict[str, Any], episodes: list[Any],
                 explore: bool | None = None, shared_data: dict | None = None,
                 metrics: MetricsLogger | None = None, **kwargs: Any) -> dict[str, Any]:
        """Write one module batch per RLModule that has runs; log the processor's stats.

        Args:
            rl_module: the Learner's (Multi)RLModule (unused).
            batch: the pipeline's batch so far; ``batch[module_id]`` is added per module.
            episodes: episodes carrying ended runs (see ``episodes.run_to_episode``).
            explore: RLlib's pipeline argument (unused).
            shared_data: RLlib's per-call dict; :data:`ADVANTAGES_KEY` switches to the
                training-cell mode (see there).
            metrics: the Learner's MetricsLogger (None: nothing logged).
            **kwargs: RLlib's pipeline arguments (``data``, ``metrics_prefix_key``; unused).

        Returns:
            ``batch`` with ``batch[module_id]`` set (format: module docstring).
        """
        advantages = (shared_data or {}).get(ADVANTAGES_KEY)
        processed = processed_by_run(episodes) if advantages is not None else {}
        for module_id, runs in runs_by_module(episodes).items():
            if module_id in batch:
                raise ValueError(f"PrefixTreeConnector: batch already has an entry for module "
                                 f"{module_id!r}; this piece must be the one that builds it")
            if advantages is None:
                result = self._processor.process(runs)
                packed, stats, malformed = result.packed, result.stats, result.malformed
            else:
                done = [processed.get(r.run_id) or process_run(r, self.config) for r in runs]
                packed = pack_runs(done, advantages, config=self.config)
                stats = merge_stats([p.digest.stats for p in done])
                malformed = {p.digest.run_id: p.digest.malformed for p in done
                             if p.digest.malformed}
            for run_id, error in malformed.items():
                logger.warning("PrefixTreeConnector: module %r: malformed run %r left out: %s",
                               module_id, run_id, error)
            batch[module_id] = packed.to_tensors()
            if metrics is not None:
                log_stats(metrics, module_id=module_id, stats=stats, packed=packed)
        return batch

    def __str__(self, indentation: int = 0) -> str:
        c = self.config
        return (" " * indentation + f"PrefixTreeConnector(pack={c.pack}, "
                f"K={c.max_trajectories_per_run}, loss_norm={c.loss_norm})")


def batch_from_packed(packed: PackedBatch) -> dict[str, torch.Tensor]:
    """The module-batch dict of a packed batch: :meth:`PackedBatch.to_tensors`."""
    return packed.to_tensors()


def packed_from_batch(module_batch: Mapping[str, Any]) -> PackedBatch:
    """Rebuild the :class:`PackedBatch` of a module batch: :meth:`PackedBatch.from_tensors`
    (extra keys such as RLlib default columns are ignored; errors name the field)."""
    return PackedBatch.from_tensors(module_batch)


def log_stats(metrics: MetricsLogger, *, module_id: str, stats: BatchStats,
              packed: PackedBatch) -> None:
    """Log one update's processor stats under ``(module_id, key)`` (keys: module docstring)."""
    values = {field: getattr(stats, field) for field in METRIC_KEYS
              if field not in ("num_targets", "num_positions")}
    values["num_targets"] = packed.num_targets
    values["num_positions"] = packed.num_positions
    for field, value in values.items():
        metrics.log_value((module_id, METRIC_KEYS[field]), value, reduce="sum")
    metrics.log_value((module_id, DEDUP_RATIO_KEY), stats.dedup_ratio, reduce="mean")
