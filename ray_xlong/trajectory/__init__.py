"""The trajectory processor (pure: no ray, no vllm).

Token-exact model-call records → trajectories → a prefix tree per run → at most K trajectories
per run, count-once loss weights on model-generated tokens → packed torch batches.
See ``processor.py`` for the pipeline and docs/design.md invariants 1–5 and 10.

May import: torch, numpy and nothing else of ours (the bottom layer; no ray, no vllm).
"""

from ray_xlong.trajectory.advantages import group_advantages
from ray_xlong.trajectory.assembly import GeneratedSpan, Trajectory, assemble
from ray_xlong.trajectory.loss import LossConfig, policy_loss
from ray_xlong.trajectory.packing import PackedBatch, pack
from ray_xlong.trajectory.processor import (BatchStats, ProcessorConfig, TrajectoryBatch,
                                            TrajectoryProcessor)
from ray_xlong.trajectory.records import (CALL_KINDS, RUN_STATUSES, AgentRun, ModelCall,
                                          RecordError, check_run)
from ray_xlong.trajectory.selection import select
from ray_xlong.trajectory.tree import PrefixTree

__all__ = [
    "AgentRun", "BatchStats", "CALL_KINDS", "GeneratedSpan", "LossConfig", "ModelCall",
    "PackedBatch", "PrefixTree", "ProcessorConfig", "RUN_STATUSES", "RecordError", "Trajectory",
    "TrajectoryBatch", "TrajectoryProcessor", "assemble", "check_run", "group_advantages",
    "pack", "policy_loss", "select",
]
