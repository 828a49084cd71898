"""Async mode: a fixed rollout pool and a fixed training pool, bounded staleness.

Cells ``0 .. rollout_cells-1`` only ever roll out; the others move to training at the start and
stay there. Rollout cells pick up new weights between requests (no role change), so the only
brake on rollout is the staleness admission. A step starts when a full batch is takeable, or
with ``streaming=True`` as soon as one group is (the step then takes groups as they end).
"""

from __future__ import annotations

from dataclasses import dataclass

from ray_xlong.scheduling.events import Event
from ray_xlong.scheduling.moves import Move, Reserve
from ray_xlong.scheduling.policy import fill_runs, spread, step_wanted, train_on
from ray_xlong.scheduling.state import ClusterState, Role


@dataclass(frozen=True, slots=True)
class AsyncPolicy:
    """Fixed pools: ``rollout_cells`` roll out, the rest train."""

    rollout_cells: int
    """Size of the rollout pool (the training pool is the remaining cells); >= 1."""
    streaming: bool = False
    """Start a step with the first ready group instead of a full batch."""
    name: str = "async"
    """Mode name in tables and logs."""

    def __post_init__(self) -> None:
        if self.rollout_cells < 1:
            raise ValueError(f"AsyncPolicy.rollout_cells: must be >= 1, got {self.rollout_cells}")

    def decide(self, state: ClusterState, event: Event) -> tuple[Move, ...]:
        """See :class:`~ray_xlong.scheduling.policy.Policy`."""
        if len(state.cells) <= self.rollout_cells:
            raise ValueError(
                f"AsyncPolicy.rollout_cells: {self.rollout_cells} leaves no training cell "
                f"of {len(state.cells)}"
            )
        if state.done:
            return ()
        moves: list[Move] = fill_runs(state, spread(state.cells[: self.rollout_cells]))
        pool = [
            c for c in state.cells[self.rollout_cells:]
            if c.idle_trainer or (c.role is Role.ROLLOUT and not c.live_runs)
        ]
        if state.step >= 0 or step_wanted(state, streaming=self.streaming):
            return tuple(moves + train_on(state, pool))
        return tuple(moves + [Reserve(c.cell) for c in pool if c.role is Role.ROLLOUT])
