"""The elastic learner group: one :class:`XLongLearner` actor per cell; cells join a step in
progress between micro-batches and the update does not depend on who trained what.

RLlib's ``LearnerGroup`` has a fixed size and reduces inside ``update``; here the actuator
streams micro-batches as groups end and cells free up::

    plan_step(digests of the groups a step took) ─► micro-batches (run ids + advantages +
                                                     weight = their normalizer share; no tokens)
    begin(step) ; join(cell) … ; submit(cell, micro, payloads) …   any cell, any order, any time
                 (the learner packs the runs from the payload refs: the Learner connector
                  pipeline, XLongLearner.accumulate_runs)
    finish() ─► reduce_step(group of the members, Σ weights, version+1) on every member:
                an all-reduce of their gradients (rank i of a sharded cell with rank i of
                the others), then one step each ─► every member holds version+1

The driver holds refs, digests and step records, never a tensor: each step's new weights and
optimizer state live on the step's members (every member applied the same update; a step
applied by one member alone also leaves a copy in that member's node's object store, so the
loss of that one process does not lose the state). A cell
that joins later, or that sat out steps, gets them from a holder peer to peer (``join``: a
broadcast between the holder's and the joiner's ranks, shard to shard, ``collectives.py``).
The groups are made per membership set on first use and cached by the members (bounded, LRU;
``collectives.PeerGroups`` keys them on the driver's rendezvous store, which carries no
tensor). ``state_ref`` / ``weights_ref`` are refs made on demand from a live holder (recovery,
checkpoints, the engines' object-store weight sync); when no learner holds the version, the
group asks its ``state_source`` (a checkpoint loader; by default an error naming the
checkpoint directory).

When the all-reduce fails (a member lost mid-reduce, a timeout), no member's gradient changed:
the step goes through the object store instead (one sum task in cell order, each member fetches
the one sum: ``reduce.py``), as it does without a rendezvous (the in-process fake).

Invariant (docs/design.md 7): for one batch, the new weights are the same whether 1 cell, several
cells, or cells joining at different micro-batches trained it (to float tolerance: only the
order of additions differs).

A learner that dies mid-step (:meth:`ElasticLearnerGroup.replace`) loses only its local
gradient: the group kept every micro-batch it handed that member this step, so they go back to
the queue and the step ends with the same update. If it dies inside :meth:`finish`, the
all-reduce fails for everyone and the object-store fallback takes the survivors' gradients:
they are *banked* (kept as object refs and added at the next attempt, which stays on the object
store) and :class:`StepIncomplete` tells the caller which micro-batches to train again.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Sequence

from ray_xlong.cells.collectives import PeerGroup, StateFrom
from ray_xlong.cells.ray_edge import RayCalls, RayEdge, actor_alive, actor_lost
from ray_xlong.cells.reduce import SCHEMES
from ray_xlong.trajectory import BatchStats, ProcessorConfig, group_advantages
from ray_xlong.trajectory.per_run import (RunDigest, merge_stats, normalizer,
                                          plan_micro_batches)

__all__ = ["ElasticLearnerGroup", "MicroBatch", "StepIncomplete", "actor_alive", "actor_lost",
           "plan_step", "state_lost"]


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


def state_lost(version: int, *, checkpoint_dir: str | None = None) -> Any:
    """The default ``state_source``: no live learner holds ``version`` and nothing else does.

    Raises:
        RuntimeError: always, naming where a checkpoint would be.
    """
    where = f" in {checkpoint_dir}" if checkpoint_dir else " (CellJobConfig.checkpoint_dir)"
    raise RuntimeError(f"ElasticLearnerGroup: every learner holding version {version} is lost; "
                       f"its state is lost (resume from a checkpoint{where})")


class ElasticLearnerGroup:
    """Learner actors by cell; a step's members change between micro-batches (module doc)."""

    def __init__(self, learners: Sequence[Any], *, state: Any = None, version: int | None = None,
                 state_source: Callable[[int], Any] | None = None,
                 reduce: str = "collective", ray: RayCalls | None = None) -> None:
        """Args:
            learners: one built ``XLongLearner`` actor handle per cell, all at version 0 with
                the same weights (or all loaded with ``state``).
            state: the state the learners were loaded with (a value or a ref), when not the
                fresh one; kept as the object-store copy of its version (``state_ref``) until
                the first step. Its version is ``version`` when given (the driver never
                fetches a ref), else ``state["version"]``.
            version: the learners' version (default: ``state``'s, else 0).
            state_source: ``state_source(version)`` → a state (value or ref) when no live
                learner holds ``version`` (a checkpoint loader); raises when it has none.
                Default :func:`state_lost`.
            reduce: ``collective`` (an all-reduce over the step's members, the object store
                as its fallback) or one of ``reduce.SCHEMES`` (the object store only).
            ray: the Ray calls (``ray_edge.RayEdge`` by default; an in-process fake in tests).
        """
        self.ray = ray if ray is not None else RayEdge()
        if reduce != "collective" and reduce not in SCHEMES:
            raise ValueError(f"ElasticLearnerGroup.reduce must be 'collective' or one of "
                             f"{SCHEMES}, got {reduce!r}")
        self.reduce = reduce
        if not learners:
            raise ValueError("ElasticLearnerGroup.learners: need at least one learner")
        self.learners = list(learners)
        if version is None:
            version = 0 if state is None or not isinstance(state, Mapping) \
                else int(state["version"])
        self.version = int(version)
        self.state_source = state_source or state_lost
        if isinstance(state, Mapping):
            state = self.ray.put(dict(state))
        self.kept: tuple[int, Any] | None = (self.version, state) if state is not None else None
        """``(version, state ref)`` of an object-store copy, the fallback of :attr:`state_ref`
        when no live learner holds that version."""
        self._weights: tuple[int, Any] | None = None
        self._made_on: dict[str, int | None] = {"kept": None, "weights": None}
        """The cell whose node stores the ``kept`` / weights copy (None: the driver's store or
        unknown): a copy lives in its maker's node's object store and is lost with that node."""
        self.learner_version = [self.version] * len(learners)
        self.members: list[int] = []
        self.held: dict[int, list[MicroBatch]] = {}
        self.banked: list[Any] = []
        self.total = 0.0
        self.step = -1
        self.lead: int | None = 0
        """A cell that holds the current version (the last step's first member to apply it)."""
        self.fallbacks = 0
        """Steps reduced through the object store after their collective failed."""
        self.peer_states = 0
        """States a joining cell loaded from a holder, peer to peer."""
        self._transfers: dict[int, tuple[int, int]] = {}
        """(holder, joiner) of each joiner's last peer-to-peer state transfer."""
        self._state_from: int | None = None
        """The holder the last :attr:`state_ref` came from (None: the kept copy)."""
        self._loading: dict[int, int] = {}
        """Cells that joined the step behind, whose wake-up (which loads the state) has not
        been seen to succeed: the version their Learner held before. Until :meth:`woke`, such a
        cell counts as a holder of nothing (its Learner may still hold the old state)."""

    # -- where the current state lives (the driver holds refs only) ----------------------------
    def holders(self) -> list[int]:
        """Cells whose learner holds the current version (weights and optimizer state): it
        applied the last step, or its load of that state was seen to succeed. A joiner whose
        wake-up is still loading is none: its state source may be lost before the load runs,
        and a state asked of it then would be its old one."""
        return [c for c, v in enumerate(self.learner_version)
                if v == self.version and c not in self._loading]

    @property
    def state_ref(self) -> Any:
        """The current state (weights + optimizer + version) as a ref: from a live holder's
        ``get_xlong_state`` (its node's object store, never the driver's), else the kept
        object-store copy of that version, else ``state_source(version)``. For recovery and
        checkpoints; a joining cell gets the state peer to peer (:meth:`join`)."""
        holder = self._live_holder()
        self._state_from = holder
        if holder is not None:
            return self.learners[holder].get_xlong_state.remote()
        if self.kept is None or self.kept[0] != self.version:
            state = self.state_source(self.version)
            self.kept = (self.version, self.ray.put(dict(state))
                         if isinstance(state, Mapping) else state)
            self._made_on["kept"] = None if isinstance(state, Mapping) else self.lead
        return self.kept[1]

    def state_ref_lost(self) -> None:
        """The state the last :attr:`state_ref` handed out was lost before it loaded: its
        holder's node is gone, though Ray has not marked the actor dead yet (that takes
        missed heartbeats), or the kept copy went with its node. That holder stops counting
        as one (a live one loads the state when it next joins) and the copies it made are
        forgotten, or the kept copy is; the next :attr:`state_ref` comes from elsewhere."""
        source = self._state_from
        if source is None:
            self.kept = None
            return
        self.learner_version[source] = -1
        self.node_lost(source)

    @property
    def weights_ref(self) -> Any:
        """The current weights as a ref, made once per version from a live holder's
        ``get_weights`` (the lead first): what engines load from the object store. The
        object outlives its learner (it lives in the node's store)."""
        if self._weights is None or self._weights[0] != self.version:
            holder = self._live_holder()
            if holder is not None:
                ref = self.learners[holder].get_weights.remote()
            else:   # no learner holds it: the recovery path, from the kept / reloaded state
                ref = self.ray.put(self.ray.get(self.state_ref)["weights"])
            self._weights = (self.version, ref)
            self._made_on["weights"] = holder
        return self._weights[1]

    def reloaded(self, cell: int, learner: Any, version: int) -> None:
        """``cell``'s ``learner`` holds ``version`` again (recovery reloaded a checkpoint and
        replayed the steps since): it becomes the lead holder; weights are taken from it anew."""
        self.learners[cell] = learner
        self.learner_version[cell] = version
        self._loading.pop(cell, None)
        self.lead = cell
        self._weights = None

    def node_lost(self, cell: int) -> None:
        """``cell``'s node is gone, and with it every object its Learner made there: the kept
        state and the weights copy it made are forgotten (made again from a live holder, else
        from ``state_source``, when next asked for). Without this a retired cell's rebuild
        loads a lost object forever."""
        if self.kept is not None and self._made_on["kept"] == cell:
            self.kept = None
        if self._weights is not None and self._made_on["weights"] == cell:
            self._weights = None

    def forget_copies(self) -> None:
        """The object-store copies of the state and weights may be lost (a load of one failed,
        its node unknown): both are made again from a live holder, else from
        ``state_source``, when next asked for."""
        self.kept = None
        self._weights = None

    def _live_holder(self) -> int | None:
        """A cell whose learner holds the current version and is alive (idle ones and the lead
        first; one found dead stops counting as a holder), or None."""
        for c in self._by_preference(self.holders()):
            if self.ray.alive(self.learners[c]):
                return c
            self.learner_version[c] = -1
        return None

    def _by_preference(self, cells: Sequence[int]) -> list[int]:
        """``cells``, those not in the step in progress first (idle: a state request does not
        wait behind their micro-batches)."""
        return sorted(cells, key=lambda c: (c in self.members, c != self.lead, c))

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
        state = None
        if self.learner_version[cell] != self.version:       # behind: the state comes along
            source = [c for c in self._by_preference(self.holders()) if c != cell]
            groups = self._peer_groups("state", source[:1] + [cell])
            if groups is None:
                state = self.state_ref
            else:
                self.peer_states += 1
                self.learners[source[0]].send_state.remote(StateFrom(groups[source[0]],
                                                                     self.version))
                state = StateFrom(groups[cell], self.version)
                self._transfers[cell] = (source[0], cell)
        self.members.append(cell)
        self.held.setdefault(cell, [])
        if state is not None:
            self._loading[cell] = self.learner_version[cell]
        else:
            self._loading.pop(cell, None)
        self.learner_version[cell] = self.version
        return self.learners[cell].wake_up.remote(state, after)

    def brings_state(self, cell: int) -> bool:
        """``cell`` joined the step behind and its wake-up, which loads the state, has not
        been seen to succeed (:meth:`woke`) or fail (:meth:`wake_failed`). Its Learner must
        not train before that."""
        return cell in self._loading

    def woke(self, cell: int) -> None:
        """``cell``'s wake-up into the step succeeded: it holds the step's version."""
        self._loading.pop(cell, None)

    def wake_failed(self, cell: int) -> None:
        """``cell``'s wake-up into the step failed (``join`` counted it a holder of the step's
        version at once): its Learner still holds what it held before (a state that did not
        arrive loads nothing; a lost dependency means the call never ran), so the next join
        brings the state along if it was behind."""
        if cell in self._loading:
            self.learner_version[cell] = self._loading.pop(cell)

    def transfer_failed(self, cell: int) -> None:
        """``cell``'s state transfer from its holder broke: their group is made anew next
        time (the cell's Learner is replaced: ``Recovery.switch_failed``)."""
        pair = self._transfers.pop(cell, None)
        if pair is not None and self._rendezvous() is not None:
            self.ray.peer_groups().failed("state", pair)

    def _peer_groups(self, kind: str, cells: Sequence[int]) -> dict[int, PeerGroup] | None:
        """The :class:`PeerGroup` of each of ``cells`` (their order: positions) for ``kind``
        (``state``: holder, joiner; ``reduce``: the members), or None when the collectives
        are off, the Ray edge has no rendezvous, or ``cells`` differ in ranks (shard
        layouts)."""
        peers = self._rendezvous()
        if peers is None or len(cells) < 2:
            return None
        ranks = {_ranks(self.learners[c]) for c in cells}
        if len(ranks) != 1:
            return None
        return peers.groups(kind, tuple(cells))

    def _rendezvous(self) -> Any:
        """The Ray edge's ``collectives.PeerGroups`` (None: collectives off, or an edge
        without one — everything then goes through the object store)."""
        if self.reduce != "collective":
            return None
        rendezvous = getattr(self.ray, "peer_groups", None)
        return rendezvous() if rendezvous is not None else None

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
        self._loading.pop(cell, None)
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

        The members all-reduce their gradients over a group of theirs (:meth:`_collective`);
        when that fails (a member lost mid-reduce, a timeout) nobody's gradient changed and
        the step goes through the object store (``reduce.py``) instead.

        Raises:
            StepIncomplete: members died before the update was applied (see module docstring).
        """
        if self.step < 0 or not self.members:
            raise RuntimeError(f"ElasticLearnerGroup.finish: step {self.step} has no members")
        members = sorted(self.members)
        new = self.version + 1
        outcome = self._collective(members, new)
        if outcome is None:
            done, dead = self._object_store(members, new)
        else:
            done, dead = outcome
        for c in done:
            self.learner_version[c] = new
            self._loading.pop(c, None)         # it applied the step: its load went through
        for c in members:
            if c not in done:
                self.learner_version[c] = -1     # behind (or dead): reloads when it joins
                self._loading.pop(c, None)
        self.lead = done[0]
        self.version, self.step, self.members = new, -1, []
        self.held, self.banked = {}, []
        if len(done) < 2:
            # One process holds the new state: keep a copy in its node's object store (not the
            # driver's), which outlives that learner; weights and state, made now.
            lead = self.learners[done[0]]
            self.kept = (new, lead.get_xlong_state.remote())
            self._weights = (new, lead.get_weights.remote())
            self._made_on = {"kept": done[0], "weights": done[0]}
            self.ray.wait([self.kept[1], self._weights[1]], num_returns=2, timeout=None)
        return dead

    def _collective(self, members: list[int], new: int) -> tuple[list[int], list[int]] | None:
        """``reduce_step`` on every member over the members' group. Returns ``(applied,
        died)``, or None when no member applied (collectives off or failed: fall back)."""
        if self.banked or self._rendezvous() is None:
            return None
        if len(members) == 1:       # alone: its own gradient is the step's (no group)
            groups = {members[0]: None}
        else:
            groups = self._peer_groups("reduce", members)
            if groups is None:
                return None
        applied = {c: self.learners[c].reduce_step.remote(groups[c], self.total, new)
                   for c in members}
        done, dead = [], []
        for c in members:
            try:
                self.ray.get(applied[c])
                done.append(c)
            except self.ray.Error as exc:
                if self.ray.lost(exc):
                    dead.append(c)
        if len(done) == len(members):
            return done, dead
        if len(members) > 1:
            self.ray.peer_groups().failed("reduce", tuple(members))
        if done:   # the all-reduce completed somewhere: every gradient is in those updates
            return done, dead
        self.fallbacks += 1
        return None

    def _object_store(self, members: list[int], new: int) -> tuple[list[int], list[int]]:
        """The object-store reduction (``reduce.py``): ``take_gradients`` on every member, the
        sum by Ray tasks, ``apply_step`` on every member. Returns ``(applied, died)``.

        Raises:
            StepIncomplete: nobody applied the update (see module docstring).
        """
        scheme = "leader" if self.reduce == "collective" else self.reduce
        grads = {c: self.learners[c].take_gradients.remote() for c in members}
        parts = self.ray.reduce(self.banked + [grads[c] for c in members], scheme=scheme)
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
            # The one place gradient values reach the driver: a fault inside the fallback.
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
        return done, dead

    def sleep(self, cell: int):
        """Put ``cell``'s learner to sleep (it lends memory to the engine). Returns a ref."""
        self._loading.pop(cell, None)     # its wake-up went through
        return self.learners[cell].sleep.remote()

    def _gradient(self, ref: Any) -> Any:
        """The value of a ``take_gradients`` ref, or None when its learner died before it."""
        try:
            return self.ray.get(ref, timeout=120)
        except self.ray.Error as exc:
            if self.ray.lost(exc):
                return None
            raise


def _ranks(learner: Any) -> int:
    """Learner ranks behind a handle (a ``sharded_cell.ShardedCell`` lists its ranks; else 1)."""
    ranks = getattr(learner, "ranks", None)
    return len(ranks) if isinstance(ranks, list) else 1
