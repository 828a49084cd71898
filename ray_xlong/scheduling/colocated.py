"""Colocated mode: every cell rolls out, waits for the slowest run, trains, syncs — together.

A round rolls out every group the staleness bound admits (``b + 1`` steps' worth at the start of
the round), waits until all of its runs ended, then all cells train the round's steps one after
another and sync back to rollout together. With ``streaming=True`` (the ablation) a cell that
has emptied while others still roll out starts training the ready groups at once and later
cells join the step in progress; the cluster still returns to rollout as one.

The decision depends only on the snapshot: the round is in rollout while no cell trains (or,
taking over mid-job from another plan, while rollout cells still serve runs: ``_take_over``).
"""

from __future__ import annotations

from dataclasses import dataclass

from ray_xlong.scheduling.events import Event
from ray_xlong.scheduling.moves import Drain, Move, Reserve, Sync
from ray_xlong.scheduling.policy import fill_runs, spread, step_wanted, train_on
from ray_xlong.scheduling.state import ClusterState, Role


@dataclass(frozen=True, slots=True)
class ColocatedPolicy:
    """All cells switch together (``streaming``: cells may start training as they empty)."""

    streaming: bool = False
    """Start training on ready groups while other cells still finish their runs."""
    name: str = "colocated"
    """Mode name in tables and logs."""

    def decide(self, state: ClusterState, event: Event) -> tuple[Move, ...]:
        """See :class:`~ray_xlong.scheduling.policy.Policy`."""
        if state.with_role(Role.SYNCING) or state.done:
            return ()  # the cluster returns to rollout as one
        rollout = state.with_role(Role.ROLLOUT)
        moves: list[Move] = []
        if len(rollout) == len(state.cells):
            moves += fill_runs(state, spread(rollout))
            launched = sum(m.count for m in moves)
            if launched or state.startable_runs:
                return tuple(moves)
            if state.live_runs + launched and not self.streaming:
                return tuple(moves)
        return tuple(moves + self._train(state))

    def _train(self, state: ClusterState) -> list[Move]:
        trainers = [c for c in state.with_role(Role.TRAINING) if c.step < 0]
        taken_over = self._take_over(state, trainers)
        if taken_over is not None:
            return taken_over
        moves: list[Move] = [Drain(c.cell) for c in state.with_role(Role.ROLLOUT) if c.live_runs]
        empty = [c for c in state.with_role(Role.ROLLOUT, Role.DRAINING) if not c.live_runs]
        if state.step >= 0 or step_wanted(state, streaming=self.streaming):
            return moves + train_on(state, trainers + empty)
        if len(trainers) == len(state.cells):  # the round is trained (groups left over
            return [Sync(c.cell, state.version) for c in trainers]  # from another plan wait)
        return moves + [Reserve(c.cell) for c in empty]

    def _take_over(self, state: ClusterState, trainers: list) -> list[Move] | None:
        """Taking over mid-job from another plan (``sim.planner``): rollout cells still serve
        runs while others train (a state colocated itself never makes: it drains every
        rollout cell at once). The round stays in rollout: the trainers already there train
        the steps that are wanted, then sync back. None: not this case."""
        serving = [c for c in state.with_role(Role.ROLLOUT) if c.live_runs]
        if not serving or state.with_role(Role.DRAINING):
            return None
        if state.step >= 0 or (trainers and step_wanted(state, streaming=self.streaming)):
            return train_on(state, trainers)  # the backlog trains on the cells already there
        if trainers:
            return [Sync(c.cell, state.version) for c in trainers]
        return None
