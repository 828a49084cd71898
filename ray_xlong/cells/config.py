"""``CellJobConfig``: one record for a job on cells — mode, job shape, layout, rollout, learner
(``LearnerSettings``, ``learner_settings.py``: what a cell's Learner trains and how; re-exported
here).

The mode is one field; every mode runs the same actuator (``actuator.py``), only the policy
object changes: :func:`make_policy` asks the one mode registry, ``ray_xlong.scheduling.modes``.
"""

from __future__ import annotations

import dataclasses

from ray_xlong.cells.broadcast import SCHEMES
from ray_xlong.cells.learner_settings import ATTENTIONS, DTYPES, LearnerSettings
from ray_xlong.cells.layout import CellLayout
from ray_xlong.checks import check_int
from ray_xlong.cells.long_horizon_job import LongHorizonJob
from ray_xlong.cells.sharding import (ShardingSettings, check_model_fits, model_num_params,
                                      ranks_per_bundle)
from ray_xlong.rollout import HarnessConfig
from ray_xlong.scheduling import Policy, SchedulingConfig, modes
from ray_xlong.trajectory import ProcessorConfig
from ray_xlong.trajectory.context_parallel import check_context_parallel

__all__ = ["ATTENTIONS", "DTYPES", "MODES", "CellJobConfig", "LearnerSettings", "make_policy"]

MODES = modes.CELL_MODES
"""Valid ``CellJobConfig.mode`` values (``scheduling.modes``, the one registry)."""


@dataclasses.dataclass(frozen=True, slots=True)
class CellJobConfig:
    """A job on cells (each field validated at construction)."""

    mode: str
    """One of :data:`MODES`."""
    job: SchedulingConfig
    """Steps, groups per step, runs per group, staleness bound."""
    layout: CellLayout
    """Cells and their placement."""
    learner: LearnerSettings
    """Model, optimizer, loss, micro-batch size."""
    slots_per_cell: int = 4
    """Runs one rollout cell serves at once."""
    async_rollout_cells: int = 1
    """Rollout pool of the async modes."""
    work: LongHorizonJob = LongHorizonJob()
    """The task runs do."""
    harness: HarnessConfig = HarnessConfig(max_new_tokens=32, wall_clock_s=8.0,
                                           tool_timeout_s=8.0)
    """Run budgets (``wall_clock_s`` is the run timeout)."""
    processor: ProcessorConfig = ProcessorConfig()
    """Trajectory processor (tree packing, K, loss normalisation)."""
    poll_s: float = 0.5
    """Longest a runner's ``wait_ended`` blocks."""
    spool_dir: str | None = None
    """Where runners spool ended runs before handing them over (``spool.py``); on a cluster,
    storage every node sees. None: no spool (a runner that dies loses runs it had not handed
    over yet)."""
    checkpoint_dir: str | None = None
    """Where the driver saves its checkpoint at step boundaries (``actuator.py``); None: off."""
    checkpoint_every: int = 1
    """Steps between driver checkpoints."""
    sharding: ShardingSettings = ShardingSettings()
    """A training cell's Learner ranks (``cells/sharded.py``; default: one Learner per cell)."""
    weight_sync: str | None = None
    """How a step's weights reach the engines of the cells not training (``cells/broadcast.py``):
    ``object_store`` (a ref the Learner made, each runner fetches it) or ``broadcast`` (buckets
    over a process group from the Learner to the runners: gloo on CPU, NCCL with
    ``sharding.device='cuda'``). None: ``broadcast`` on CUDA, ``object_store`` on CPU."""
    weight_sync_bucket_mb: float = 256.0
    """Bucket size cap of the broadcast (staging memory on each side is one bucket)."""
    weight_sync_timeout_s: float = 60.0
    """Bound of each broadcast's rendezvous and collectives; the driver waits at most twice it
    for a whole push (a peer lost mid-sync fails the sync; the targets left then get the
    weights by the object store)."""

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"CellJobConfig.mode must be one of {MODES}, got {self.mode!r}")
        for name in ("slots_per_cell", "async_rollout_cells"):
            check_int("CellJobConfig", name, getattr(self, name), minimum=1)
        if self.mode.startswith("async") and not 1 <= self.async_rollout_cells < self.layout.cells:
            raise ValueError(f"CellJobConfig.async_rollout_cells must be in [1, cells-1] = "
                             f"[1, {self.layout.cells - 1}], got {self.async_rollout_cells!r}")
        if self.processor.pack == "none":
            raise ValueError("CellJobConfig.processor.pack must be 'tree' or 'per_trajectory'")
        if self.checkpoint_every < 1:
            raise ValueError(f"CellJobConfig.checkpoint_every must be >= 1, "
                             f"got {self.checkpoint_every!r}")
        if self.checkpoint_dir and not self.spool_dir:
            raise ValueError("CellJobConfig.checkpoint_dir needs spool_dir too (runs that end "
                             "after a checkpoint survive a driver restart only in the spool)")
        if not self.poll_s > 0:
            raise ValueError(f"CellJobConfig.poll_s must be > 0, got {self.poll_s!r}")
        if self.weight_sync not in (None,) + SCHEMES:
            raise ValueError(f"CellJobConfig.weight_sync must be one of {SCHEMES} or None, "
                             f"got {self.weight_sync!r}")
        for name in ("weight_sync_bucket_mb", "weight_sync_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"CellJobConfig.{name} must be > 0, got {getattr(self, name)!r}")
        _check_context_parallel(self)
        ranks_per_bundle(self.sharding, nodes_per_cell=self.layout.nodes_per_cell,
                         gpus_per_node=self.layout.gpus_per_node)   # before any actor starts
        if self.sharding.memory_per_rank_gb is not None:
            check_model_fits(self.sharding, num_params=model_num_params(self.learner.model_dir))

    @property
    def weight_sync_scheme(self) -> str:
        """``weight_sync`` with its default resolved (``broadcast`` on CUDA)."""
        if self.weight_sync is not None:
            return self.weight_sync
        return "broadcast" if self.sharding.device == "cuda" else "object_store"


def _check_context_parallel(config: CellJobConfig) -> None:
    """``learner.context_parallel`` divides the cell's ranks and trains tree rows."""
    cp = config.learner.context_parallel
    if cp == 1:
        return
    check_context_parallel(cp, config.sharding.ranks_per_cell)
    if config.processor.pack != "tree":
        raise ValueError(f"LearnerSettings.context_parallel={cp} splits tree rows; "
                         f"CellJobConfig.processor.pack is {config.processor.pack!r}")


def make_policy(config: CellJobConfig) -> Policy:
    """The scheduling policy of ``config.mode`` (the registry's objects, as the simulator)."""
    from ray_xlong.sim.planner import PlanCosts, planned_policy  # the driver waits for a step

    return modes.make_policy(config.mode, modes.ModeInputs(
        async_rollout_cells=config.async_rollout_cells,
        planner=lambda: planned_policy(costs=PlanCosts(finish_blocks=True))))
