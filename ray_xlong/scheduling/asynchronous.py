"""Async mode: a fixed rollout pool and a fixed training pool, bounded staleness.

Cells ``0 .. rollout_cells-1`` only ever roll out; the others move to training at the start and
stay there. Rollout cells pick up new weights between requests (no role change), so the only
brake on rollout is the staleness admission. A step starts when a full batch is takeable, or
with ``streaming=True`` as soon as one group is (the step then takes groups as they end).

Taking over mid-job (``sim.planner`` switches plans): a rollout-pool cell found training syncs
back, a draining one trains once empty and then syncs back; a training-pool cell still rolling
out joins the pool when its runs have ended. From a fresh start none of this arises.
"""

from __future__ import annotations

from dataclasses import dataclass

from ray_xlong.scheduling.events import Event
from ray_xlong.scheduling.moves import Move, Reserve, Sync
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
        head, tail = state.cells[: self.rollout_cells], state.cells[self.rollout_cells:]
        moves: list[Move] = fill_runs(state, spread(head))
        moves += [Sync(c.cell, state.version) for c in head if c.idle_trainer]
        pool = [
            c for c in tail
            if c.idle_trainer or (c.role in (Role.ROLLOUT, Role.DRAINING) and not c.live_runs)
        ]
        pool += [c for c in head if c.role is Role.DRAINING and not c.live_runs]
        if state.step >= 0 or step_wanted(state, streaming=self.streaming):
            return tuple(moves + train_on(state, pool))
        return tuple(moves + [Reserve(c.cell) for c in pool if c.role is not Role.TRAINING])
