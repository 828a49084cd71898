"""The elastic learner group: one :class:`XLongLearner` actor per cell; cells join a step in
progress between micro-batches and the update does not depend on who trained what.

RLlib's ``LearnerGroup`` has a fixed size and reduces inside ``update``; here the actuator
streams micro-batches as groups end and cells free up::

    plan_step(digests of the groups a step took) ─► micro-batches (run ids + advantages +
                                                     weight = their normalizer share; no tokens)
    begin(step) ; join(cell) … ; submit(cell, micro, payloads) …   any cell, any order, any time
                 (the learner packs the runs from the payload refs: the Learner connector
                  pipeline, XLongLearner.accumulate_runs)
    finish() ─► take_gradients on every member ─► apply_step(all grads, Σ weights) on every
                member ─► state (weights + Adam) of version+1 in the object store

The reduce goes through the object store (one sum task in cell order, each member fetches the
one sum: ``reduce.py``), so it works across nodes and a membership that changes per step without
re-forming a collective group; every member ends on identical weights and optimizer state. A
cell that joins later, or that sat out steps, first loads the latest state (``join``).

Invariant (docs/design.md 7): for one batch, the new weights are the same whether 1 cell, several
cells, or cells joining at different micro-batches trained it (to float tolerance: only the
order of additions differs).

A learner that dies mid-step (:meth:`ElasticLearnerGroup.replace`) loses only its local
gradient: the group kept every micro-batch it handed that member this step, so they go back to
the queue and the step ends with the same update. If it dies inside :meth:`finish`, the
survivors' gradients are already taken: they are *banked* (kept as object refs and added at the
next attempt) and :class:`StepIncomplete` tells the caller which micro-batches to train again.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

from ray_xlong.cells.ray_edge import RayCalls, RayEdge, actor_alive, actor_lost
from ray_xlong.trajectory import BatchStats, ProcessorConfig, group_advantages
from ray_xlong.trajectory.per_run import (RunDigest, merge_stats, normalizer,
                                          plan_micro_batches)

__all__ = ["ElasticLearnerGroup", "MicroBatch", "StepIncomplete", "actor_alive", "actor_lost",
           "plan_step"]


@dataclasses.dataclass(frozen=True, slots=True)
class MicroBatch:
    """One unit of training work sent to one cell: whole runs, by id (their tokens stay in
    the object store where the runs ended; the learner fetches them)."""

    run_ids: tuple[str, ...]
    """The runs it trains."""
    advantages: tuple[float, ...]
    """Their advantages (computed over whole groups), in the same order."""
    weight: float
    """Its share of the step's normalizer (``per_run.normalizer`` of its runs): the learner
    adds un-normalised gradients, the step divides by Σ weights."""
    targets: int
    """Target tokens it trains."""
    min_version: int
    """Oldest policy version among its targets (-1: none)."""


def plan_step(digests: Sequence[RunDigest], *, processor: ProcessorConfig,
              max_tokens: int) -> tuple[list[MicroBatch], BatchStats]:
    """Micro-batches of the ended runs of whole groups, from their digests (no tokens).

    Args:
        digests: ended runs of complete groups (advantages are per group).
        processor: ``normalize_std`` and ``loss_norm`` of the trajectory processor.
        max_tokens: micro-batch token budget (whole runs; a bigger run goes alone).

    Returns:
        ``(micro-batches, stats)``: Σ over micro-batches of their un-normalised losses ÷ Σ
        ``weight`` is the loss of all the runs processed as one batch; the merged processor
        counts of the runs.
    """
    by_id = {d.run_id: d for d in digests}
    trainable = [d for d in digests if d.malformed is None and d.status != "failed"]
    advantages = group_advantages(trainable, normalize_std=processor.normalize_std)
    out = []
    for ids in plan_micro_batches(trainable, max_tokens=max_tokens):
        ds = [by_id[r] for r in ids]
        versions = [d.min_version for d in ds if d.min_version >= 0]
        out.append(MicroBatch(ids, tuple(advantages[r] for r in ids),
                              normalizer(ds, processor.loss_norm), sum(d.targets for d in ds),
                              min(versions, default=-1)))
    return out, merge_stats([d.stats for d in digests])


class StepIncomplete(RuntimeError):
    """:meth:`ElasticLearnerGroup.finish` lost members before the update was applied; their
    micro-batches (``redo``) must be trained again by the members left, then ``finish`` again."""

    def __init__(self, lost: list[int], redo: list[MicroBatch]) -> None:
        super().__init__(f"members {lost} lost before the update; {len(redo)} micro-batches "
                         "to train again")
        self.lost, self.redo = lost, redo


class ElasticLearnerGroup:
    """Learner actors by cell; a step's members change between micro-batches (module doc)."""

    def __init__(self, learners: Sequence[Any], *, state: Any = None,
                 durable: bool = False, reduce: str = "leader",
                 ray: RayCalls | None = None) -> None:
        """Args:
            learners: one built ``XLongLearner`` actor handle per cell, all at version 0 with
                the same weights (or all loaded with ``state``).
            state: the learners' ``get_xlong_state`` (value) when they were loaded from a
                checkpoint; its version becomes the group's.
            durable: keep each step's state in the driver's object store (one copy through
                the driver per step), so that it survives the loss of the node that computed
                it; without it the state lives on a member's node.
            reduce: how the members' gradients are summed (``reduce.SCHEMES``; ``leader``,
                the cheapest measured: each member fetches one sum, not every gradient).
            ray: the Ray calls (``ray_edge.RayEdge`` by default; an in-process fake in tests).
        """
        self.ray = ray if ray is not None else RayEdge()
        self.reduce = reduce
        self.durable = durable
        if not learners:
            raise ValueError("ElasticLearnerGroup.learners: need at least one learner")
        self.learners = list(learners)
        if state is None and durable:
            state = self.ray.get(self.learners[0].get_xlong_state.remote())
        if state is None:
            self.version = 0
            self.state_ref = self.learners[0].get_xlong_state.remote()
            self.weights_ref = self.learners[0].get_weights.remote()
        else:
            self.version = int(state["version"])
            self.state_ref = self.ray.put(dict(state))
            self.weights_ref = self.ray.put(state["weights"])
        self.learner_version = [self.version] * len(learners)
        self.members: list[int] = []
        self.held: dict[int, list[MicroBatch]] = {}
        self.banked: list[Any] = []
        self.total = 0.0
        self.step = -1
        self.lead: int | None = None
        """The member whose state the last step's refs came from (it holds those weights)."""

    def begin(self, step: int) -> None:
        """Open step ``step`` (must equal the version: steps are applied in order)."""
        if self.step >= 0 or step != self.version:
            raise RuntimeError(f"ElasticLearnerGroup.begin: step {step} at version "
                               f"{self.version} (step in progress: {self.step})")
        self.step, self.members, self.total = step, [], 0.0
        self.held, self.banked = {}, []

    def join(self, cell: int, *, after: Any = None):
        """Add ``cell`` to the step; it wakes up on the step's weights (once ``after``, e.g.
        its engine's sleep ref, resolved). Returns a ref."""
        if self.step < 0 or cell in self.members:
            raise RuntimeError(f"ElasticLearnerGroup.join: cell {cell} (step {self.step}, "
                               f"members {self.members})")
        self.members.append(cell)
        self.held.setdefault(cell, [])
        behind = self.learner_version[cell] != self.version
        self.learner_version[cell] = self.version
        return self.learners[cell].wake_up.remote(self.state_ref if behind else None, after)

    def submit(self, cell: int, micro: MicroBatch, *, payloads: Sequence[Any],
               counted: bool = False):
        """Train ``micro`` on member ``cell``; ``payloads``: refs of the episode lists that
        hold its runs (Ray moves them from where the runs ended straight to the learner).
        ``counted``: its weight is already in the step's total (a micro-batch trained again).
        Returns a ref to the targets trained."""
        if cell not in self.members:
            raise RuntimeError(f"ElasticLearnerGroup.submit: cell {cell} is not in step "
                               f"{self.step} (members {self.members})")
        if not counted:
            self.total += micro.weight
        self.held[cell].append(micro)
        return self.learners[cell].accumulate_runs.remote(
            micro.run_ids, micro.advantages, self.version, *payloads)

    def replace(self, cell: int, learner: Any) -> list[MicroBatch]:
        """``cell``'s learner died and ``learner`` (built, asleep or not, any version) took its
        place. Returns the micro-batches the dead one trained this step (train them again, with
        ``counted=True``: their weights are in the total); the cell leaves the step (``join``
        it again to keep it training) and loads the latest state when it next joins."""
        self.learners[cell] = learner
        self.learner_version[cell] = -1
        redo = self.held.pop(cell, [])
        if cell in self.members:
            self.members.remove(cell)
        return redo

    def take_back(self, cell: int) -> MicroBatch:
        """The last micro-batch submitted to ``cell`` failed before training (its runs'
        payload was lost with a node): take it back (train it again with ``counted=True``)."""
        return self.held[cell].pop()

    def finish(self) -> list[int]:
        """Reduce over the members, apply one step on each; blocks until applied. Returns the
        members that died *after* the update was applied (replace them; the step is done).

        Raises:
            StepIncomplete: members died before the update was applied (see module docstring).
        """
        if self.step < 0 or not self.members:
            raise RuntimeError(f"ElasticLearnerGroup.finish: step {self.step} has no members")
        members = sorted(self.members)
        grads = {c: self.learners[c].take_gradients.remote() for c in members}
        parts = self.ray.reduce(self.banked + [grads[c] for c in members], scheme=self.reduce)
        new = self.version + 1
        applied = {c: self.learners[c].apply_step.remote(parts, self.total, new)
                   for c in members}
        dead, done = [], []
        for c in members:
            try:
                self.ray.get(applied[c])
                done.append(c)
            except self.ray.Error as exc:
                if not self.ray.lost(exc):
                    raise
                dead.append(c)
        if not done:
            # Nobody applied the update. Keep every gradient that survived (in the driver's
            # object store: its node may go next), redo the micro-batches of the lost ones.
            kept = {c: self._gradient(grads[c]) for c in members}
            lost = [c for c in members if kept[c] is None]
            gone = [c for c in members if c in dead and not self.ray.alive(self.learners[c])]
            if not lost and not gone:
                raise RuntimeError("ElasticLearnerGroup.finish: every member's update failed "
                                   "but no member or gradient was lost")
            self.banked += [self.ray.put(kept[c]) for c in members if kept[c] is not None]
            redo = [m for c in lost for m in self.held.get(c, [])]
            self.held = {c: [] for c in members if c not in gone and c not in lost}
            self.members = [c for c in members if c not in gone and c not in lost]
            raise StepIncomplete(sorted(set(lost) | set(gone)), redo)
        for c in done:
            self.learner_version[c] = new
        for c in dead:
            self.learner_version[c] = -1
        for c in done:  # any member that applied the update holds the new state
            lead = self.learners[c]
            try:
                if self.durable:
                    state = self.ray.get(lead.get_xlong_state.remote())
                    self.state_ref = self.ray.put(state)
                    self.weights_ref = self.ray.put(state["weights"])
                else:
                    self.state_ref = lead.get_xlong_state.remote()
                    self.weights_ref = lead.get_weights.remote()
                self.lead = c
                break
            except self.ray.Error as exc:
                if not self.ray.lost(exc):
                    raise
                self.learner_version[c] = -1
                dead.append(c)
        else:
            raise RuntimeError("ElasticLearnerGroup.finish: every member died right after the "
                               "update; its state is lost (resume from a checkpoint)")
        self.version, self.step, self.members = new, -1, []
        self.held, self.banked = {}, []
        return dead

    def sleep(self, cell: int):
        """Put ``cell``'s learner to sleep (it lends memory to the engine). Returns a ref."""
        return self.learners[cell].sleep.remote()

    def _gradient(self, ref: Any) -> Any:
        """The value of a ``take_gradients`` ref, or None when its learner died before it."""
        try:
            return self.ray.get(ref, timeout=120)
        except self.ray.Error as exc:
            if self.ray.lost(exc):
                return None
            raise
