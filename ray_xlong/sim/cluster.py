"""Cluster shape and cost model: what a cell holds and what training, switches and syncs cost.

Rollout is slot-bound: a cell serves at most ``slots_per_cell`` runs at once (KV cache for long
contexts), and a run's duration does not depend on load (agent runs are latency-bound: model
calls interleave with tool execution). Training is throughput-bound: a step's unique tokens ÷
(cells training × tokens per cell-hour), plus a fixed per-step cost paid once per step
(optimizer update, gradient reduce, weight broadcast). A rollout→training switch costs
``to_train_h`` (sleep the engine, wake the learner); training→rollout costs ``sync_h``
(load weights into the engine, wake it). With ``finish_blocks`` the per-step fixed cost also
stops the driver (the Ray driver's serial cost): events during it wait until it ends.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ClusterConfig:
    """Cells × nodes × GPUs and rollout slots."""

    cells: int
    """Number of cells (placement groups)."""
    nodes_per_cell: int
    """Nodes per cell."""
    gpus_per_node: int
    """GPUs per node."""
    slots_per_cell: int
    """Runs one rollout cell serves at once."""

    def __post_init__(self) -> None:
        for name in ("cells", "nodes_per_cell", "gpus_per_node", "slots_per_cell"):
            if getattr(self, name) < 1:
                raise ValueError(f"ClusterConfig.{name}: must be >= 1, got {getattr(self, name)}")

    @property
    def gpus(self) -> int:
        """GPUs in the cluster."""
        return self.cells * self.nodes_per_cell * self.gpus_per_node


@dataclass(frozen=True, slots=True)
class CostConfig:
    """Durations of training work, per-step overheads, switches and syncs (hours)."""

    train_tokens_per_cell_h: float
    """Unique tokens one cell trains per hour (forward + backward)."""
    step_fixed_h: float
    """Per-step fixed cost after the last micro-batch (optimizer, reduce, broadcast)."""
    to_train_h: float
    """Rollout → training switch."""
    sync_h: float
    """Training → rollout: weight load + engine wake."""
    parallel_training_cells: float = float("inf")
    """Most cells whose training runs at full speed at once; more training cells share that
    throughput (a test bed whose logical GPUs share a few CPU cores). inf on real GPUs."""
    finish_blocks: bool = False
    """The step's fixed cost blocks the actuator: whatever happens meanwhile (a run ends, a
    switch or sync ends) is seen, and acted on, only when the step has ended. The Ray driver
    waits for the reduce, the optimizer step and the weight push (``RayActuator._finish_step``),
    so its rollout cells start no runs in that time; False: a separate process would do it."""

    def __post_init__(self) -> None:
        if not self.parallel_training_cells >= 1:
            raise ValueError(f"CostConfig.parallel_training_cells: must be >= 1, "
                             f"got {self.parallel_training_cells}")
        if not self.train_tokens_per_cell_h > 0:
            raise ValueError(
                f"CostConfig.train_tokens_per_cell_h: must be > 0, got {self.train_tokens_per_cell_h}"
            )
        for name in ("step_fixed_h", "to_train_h", "sync_h"):
            if getattr(self, name) < 0:
                raise ValueError(f"CostConfig.{name}: must be >= 0, got {getattr(self, name)}")
