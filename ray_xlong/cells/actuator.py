"""The Ray actuator: the simulator's twin that applies a policy's moves to real cells.

```
ray.wait(pending) ──► report to CellMachine ──► CellMachine.settle: decide → apply → act
   ▲   runs ended (runner.wait_ended: digests     (the same settle loop and policy objects as
   │   + a payload ref, processed on the runner)   the simulator)          │
   │   switch / sync done (actor refs)                                     ▼
   │   micro-batch done (learner.accumulate_runs)
   └──────────────────────────────────────────── act on cells:
        StartRuns          runner.start_runs(specs)           runs stay on their cell
        Drain              runner.drain()
        Reserve/Start/Join runner.suspend() → learner.wake_up(step state)   (switch)
        Sync               learner.sleep() → runner.resume(weights, version)  (sync)
     train: groups the step takes → plan_step(digests): micro-batches of whole runs (ids +
            advantages) → awake members fetch the runs' payloads from where they ended and run
            their Learner connector pipeline; when the step holds B groups and every
            micro-batch is done: reduce + one optimizer step, new weights to every engine not
            training (between requests; object store or broadcast.py), then ``end_step``.
```

The driver holds digests and refs: a run's tokens go from the rollout cell that processed it
to the training cell that trains it (Ray inlines return values under ~100 KiB into their
owner, the driver; larger ones stay in the object store of the runner's node). Time is wall
seconds since start; a cell entering training or syncing is busy (``ready_at = ∞``) until its
actors report back, then ``ready`` is logged, as the simulator logs the end of its delays.

Invariants: every move passes the CellMachine first; a runner is suspended only after its runs
ended; every ended run is in exactly one micro-batch plan. Losses go to ``recovery.py``, driver
checkpoints to ``checkpoint.py``; an actor error that is not a death raises ``CellActorDied``.
"""

from __future__ import annotations

import collections
import os
import time
from typing import Any, Sequence

import ray

from ray_xlong.cells.broadcast import broadcast_sync
from ray_xlong.cells.config import CellJobConfig
from ray_xlong.cells.records import CellActorDied, EndedRun, FaultRecord, Pending, StepObserver
from ray_xlong.cells.learner_group import (ElasticLearnerGroup, MicroBatch, StepIncomplete,
                                           actor_alive, actor_lost, plan_step)
from ray_xlong.cells.metrics import RayResult, job_result
from ray_xlong.cells.pool import CellPool
from ray_xlong.cells.runs import run_index
from ray_xlong.cells.spool import RunSpool
from ray_xlong.scheduling import (CellMachine, Drain, JoinStep, Policy, Reserve, Role, StartRuns,
                                  StartTraining, Sync)
from ray_xlong.trajectory.per_run import RunDigest

__all__ = ["CellActorDied", "EndedRun", "Pending", "RayActuator", "StepObserver"]
INF = float("inf")
MAX_ROUNDS = 16


class RayActuator:
    """Drives one job on a :class:`CellPool` with one policy (see module docstring).

    Args:
        config: the job.
        policy: the scheduling policy (the simulator's objects).
        pool: the cells.
        version_offset: the policy version of scheduler step 0 (a job restored at version v).
        observer: told about runs and steps as they happen (:class:`StepObserver`).
    """

    def __init__(self, config: CellJobConfig, policy: Policy, pool: CellPool, *,
                 version_offset: int = 0, observer: StepObserver | None = None) -> None:
        from ray_xlong.cells.recovery import Recovery

        if len(pool.cells) != config.layout.cells:
            raise ValueError(f"RayActuator.pool: {len(pool.cells)} cells, config.layout "
                             f"wants {config.layout.cells}")
        self.cfg, self.policy, self.pool = config, policy, pool
        self.cells = pool.cells
        self.version_offset, self.observer = version_offset, observer
        self.m = CellMachine(config.job, slots=[config.slots_per_cell] * len(self.cells))
        self.learners: ElasticLearnerGroup | None = None  # built on the start state in run()
        self.pending: dict[Any, Pending] = {}
        self.ended: dict[int, list[EndedRun]] = collections.defaultdict(list)  # by group
        self.held_runs: dict[str, EndedRun] = {}  # delivered, not yet in a finished step
        self.queue: collections.deque[tuple[MicroBatch, bool]] = collections.deque()
        self.in_flight: dict[int, float] = {}  # cell -> dispatch time
        self.chain: dict[int, Any] = {}  # cell -> ref of its runner's last ordered call
        self.awake: set[int] = set()
        self.stats = collections.defaultdict(list)
        self.trained: dict[int, list[str]] = {}  # step -> run ids it trained
        self.token_staleness = 0
        self.t0 = time.monotonic()
        self.spool = RunSpool(config.spool_dir) if config.spool_dir else None
        self.spooled_trained: set[str] = set()  # trained run ids still in the spool
        self.recovery = Recovery(self)
        self.resumed_at: float | None = None
        """Unix time a resume from a checkpoint finished (None: not resumed)."""
        self.injector: Any = None
        """Optional ``tick(actuator)`` called once per loop (``faults.FaultInjector``)."""
        self.sync = broadcast_sync(config)  # BroadcastWeights, or None: the object store

    def now(self) -> float:
        return time.monotonic() - self.t0

    # -- read API --------------------------------------------------------------------------------
    @property
    def faults(self) -> list[FaultRecord]:
        """One record per recovery so far (``RayResult.faults``)."""
        return self.recovery.records

    @property
    def retired(self) -> set[int]:
        """Cells whose node was lost and that are not rebuilt yet."""
        return self.recovery.retired

    def runs_ended(self) -> int:
        """Runs that ended so far (restarted ones count once)."""
        return self.m.runs_ended()

    def cells_with_live_runs(self) -> list[int]:
        """Cells (not retired) serving at least one run."""
        return [c for c in range(len(self.cells)) if c not in self.retired and self.m.live[c]]

    def training_cells(self) -> list[int]:
        """Members of the step in progress, those mid micro-batch first."""
        members = self.learners.members if self.learners else []
        return sorted(members, key=lambda c: c not in self.in_flight)

    # -- the loop ----------------------------------------------------------------------------
    def run(self, *, resume_from: str | os.PathLike | None = None) -> RayResult:
        """Run the job to its last step; returns the event log and measurements.

        Args:
            resume_from: a driver checkpoint (``checkpoint.CHECKPOINT`` in
                ``CellJobConfig.checkpoint_dir``) of an earlier driver of this job.
        """
        from ray_xlong.cells import checkpoint

        if resume_from is not None:
            checkpoint.resume(self, resume_from)
        else:
            if self.spool is not None:  # runs of an earlier job or attempt are not ours
                self.spool.discard(self.spool.run_ids())
            self.start(self.pool.initial_state, self.pool.initial_weights)
        self.act()
        while not self.m.done:
            self.tick()
        return self.result()

    def start(self, state: Any, weights: Any) -> None:
        """Every cell in rollout on ``weights``, learners asleep on ``state`` (refs of the
        learner state / weights the job starts from); runs are watched from now on."""
        version = self.version_offset
        calls = []
        for cell in self.cells:
            calls += [cell.learner.set_xlong_state.remote(state), cell.learner.sleep.remote(),
                      cell.runner.resume.remote(weights, version)]
        ray.get(calls)
        # The state lives in the driver's object store, so it outlives any node (durable).
        self.learners = ElasticLearnerGroup([c.learner for c in self.cells],
                                            state=ray.get(state), durable=True)
        self.t0 = time.monotonic()
        for c in range(len(self.cells)):
            self.watch_runs(c)

    def tick(self) -> None:
        """One turn of the loop: faults (if injected), reports, rebuilds, training, moves."""
        if self.injector is not None:
            self.injector.tick(self)
        self.poll()
        self.recovery.check_retired()
        self.train()
        self.act()

    def rcall(self, cell: int, method: str, *args: Any):
        """Call a role method of ``cell``'s runner after its previous one (Ray does not order
        the calls of an actor with concurrency groups: a ``drain`` sent after a
        ``start_runs`` could run first and make it refuse the runs)."""
        prev = self.chain.get(cell)
        ref = getattr(self.cells[cell].runner, method).remote(
            *args, *(() if prev is None else (prev,)))
        self.chain[cell] = ref
        return ref

    def watch_runs(self, cell: int) -> None:
        """Ask ``cell``'s runner for the runs that end next (digests + a payload ref)."""
        digests, payload = self.cells[cell].runner.wait_ended.remote(self.cfg.poll_s)
        self.pending[digests] = Pending("ended", cell, self.now(), payload)

    def poll(self) -> None:
        """Wait for at least one pending ref, handle every one that is ready."""
        refs = list(self.pending)
        ready, _ = ray.wait(refs, num_returns=1, timeout=self.cfg.poll_s)
        if ready:
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        for ref in ready:
            p = self.pending.pop(ref, None)
            if p is None:  # dropped by a recovery earlier in this loop
                continue
            try:
                value = ray.get(ref)
            except ray.exceptions.RayError as exc:
                if not actor_lost(exc):
                    raise CellActorDied(f"cell {p.cell}: {p.kind} failed: {exc}") from exc
                if p.kind == "micro" and actor_alive(self.cells[p.cell].learner):
                    self._train_again(p.cell)  # its runs' payload went with a node
                    continue
                self.recovery.recover(p.cell, f"{p.kind} failed")
                continue
            getattr(self, f"_on_{p.kind}")(p, value)

    def _on_ended(self, p: Pending, digests: list[RunDigest]) -> None:
        self.deliver(p.cell, digests, p.payload)
        self.watch_runs(p.cell)

    def deliver(self, cell: int, digests: Sequence[RunDigest], payload: Any, *,
                payload_cell: int | None = None) -> None:
        """Runs that ended on ``cell``, each taken once; ``payload``: the ref of their
        episodes, processed on ``payload_cell`` (default: ``cell``)."""
        where = cell if payload_cell is None else payload_cell
        for d in digests:
            run = run_index(d.run_id)
            if run not in self.m.live[cell]:  # delivered already (from the spool)
                continue
            self.m.run_ended(cell, run, self.now())
            ended = EndedRun(d, payload, where)
            self.ended[run // self.cfg.job.runs_per_group].append(ended)
            self.held_runs[d.run_id] = ended
            if self.observer is not None:
                self.observer.delivered(d)

    def _on_started(self, p: Pending, value: Any) -> None:  # a refusal raised in ``poll``
        pass

    def _on_switch(self, p: Pending, value: Any) -> None:
        self.stats["switch_s"].append(self.now() - p.issued)
        if self.m.role[p.cell] is Role.SYNCING:  # sent back before its switch ended: the
            return                              # sync's end makes it ready
        self.awake.add(p.cell)
        self.ready(p.cell)

    def _on_sync(self, p: Pending, value: Any) -> None:
        self.stats["sync_s"].append(self.now() - p.issued)
        self.ready(p.cell)

    def _on_micro(self, p: Pending, targets: int) -> None:
        now = self.now()
        self.stats["micro_batch_s"].append(now - self.in_flight.pop(p.cell))
        self.stats["micro_batch_targets"].append(targets)
        self.m.micro_batch_done(p.cell, now)

    def ready(self, cell: int) -> None:
        """``cell``'s switch or sync finished: it is ready for its role."""
        now = self.now()
        self.m.busy_until(cell, now)
        self.m.cell_ready(cell, now)

    # -- deciding and acting -----------------------------------------------------------------
    def act(self) -> None:
        """Settle: ask the policy until it has no more moves at this instant, applying each
        (the machine's ``settle`` loop, shared with the simulator) and acting on the cells."""
        def apply(move, runs: list[int], was_training: bool) -> None:
            self._act(move, runs, was_training)

        self.m.settle(self.policy, self.now, apply=apply, after_round=self.train,
                      max_rounds=MAX_ROUNDS + 4 * len(self.cells))

    def _act(self, move, runs: list[int], was_training: bool) -> None:
        cell, c = move.cell, self.cells[move.cell]
        if isinstance(move, StartRuns):
            g = self.cfg.job.runs_per_group
            ref = self.rcall(cell, "start_runs", [self.cfg.work.spec(r, runs_per_group=g)
                                                  for r in runs])
            self.pending[ref] = Pending("started", cell, self.now())  # a refusal fails loudly
        elif isinstance(move, Drain):
            self.rcall(cell, "drain")
        elif isinstance(move, (Reserve, StartTraining, JoinStep)):
            if isinstance(move, StartTraining):
                self.learners.begin(move.step + self.version_offset)
            after = None
            if not was_training:
                self.m.busy_until(cell, INF)
                after = self.rcall(cell, "suspend")
            if isinstance(move, Reserve):
                ref = c.learner.wake_up.remote(None, after)
            else:
                ref = self.learners.join(cell, after=after)
            if not was_training:
                self.pending[ref] = Pending("switch", cell, self.now())
        elif isinstance(move, Sync):
            self.m.busy_until(cell, INF)
            self.awake.discard(cell)
            slept = self.learners.sleep(cell)
            ref = self.rcall(cell, "resume", self.learners.weights_ref, self.learners.version,
                             slept)
            self.pending[ref] = Pending("sync", cell, self.now())

    # -- training ------------------------------------------------------------------------------
    def train(self) -> None:
        """Plan newly taken groups, feed awake members, finish a complete step."""
        groups = self.m.take_groups()
        if groups:
            ended = [e for g in groups for e in self.ended.pop(g)]
            micro, stats = plan_step([e.digest for e in ended], processor=self.cfg.processor,
                                     max_tokens=self.cfg.learner.micro_batch_tokens)
            self.queue.extend((mb, False) for mb in micro)
            self.trained.setdefault(self.m.step, []).extend(e.digest.run_id for e in ended)
            if self.observer is not None:
                self.observer.taken(self.m.step, micro, stats)
        if self.m.step < 0:
            return
        self._dispatch()
        if self.queue or self.in_flight:
            self.m.set_starved(False, self.now())
        elif self.m.step_groups == self.cfg.job.batch_groups:
            self._finish_step()
        else:
            self.m.set_starved(True, self.now())

    def _dispatch(self) -> None:
        members = [c for c in self.learners.members
                   if c in self.awake and c not in self.in_flight]
        for cell in members:
            if not self.queue:
                return
            micro, counted = self.queue.popleft()
            if micro.min_version >= 0:
                stale = self.m.step + self.version_offset - micro.min_version
                self.token_staleness = max(self.token_staleness, stale)
                if self.observer is not None:
                    self.observer.staleness(self.m.step, stale)
            payloads = list(dict.fromkeys(self.held_runs[r].payload for r in micro.run_ids))
            ref = self.learners.submit(cell, micro, payloads=payloads, counted=counted)
            self.in_flight[cell] = self.now()
            self.pending[ref] = Pending("micro", cell, self.now())

    def requeue(self, redo: list[MicroBatch]) -> list[MicroBatch]:
        """Put micro-batches a lost learner had trained back at the head of the queue (their
        weights are already counted). Returns them."""
        self.queue.extendleft((mb, True) for mb in reversed(redo))
        return redo

    def _train_again(self, cell: int) -> None:
        """``cell``'s micro-batch failed because its runs' payload was lost (with a node):
        queue it again; the recovery of that node rebuilds the payload from the spool."""
        self.in_flight.pop(cell, None)
        self.requeue([self.learners.take_back(cell)])

    def _finish_step(self) -> None:
        if not self.learners.members:  # every member was lost; wait for one to (re)join
            return
        t = time.perf_counter()
        members = len(self.learners.members)
        try:
            lost_after = self.learners.finish()
        except StepIncomplete as inc:
            self.requeue(inc.redo)
            for cell in inc.lost:
                self.recovery.recover(cell, "lost during the step's reduce")
            return
        self.stats["step_members"].append(members)
        failed = list(lost_after) + self._push_weights()
        self.stats["step_finish_s"].append(time.perf_counter() - t)
        self._forget_trained(self.trained.get(self.m.step, []))
        self.m.end_step(self.now())
        for cell in dict.fromkeys(failed):  # after end_step: the step is over for everyone
            self.recovery.recover(cell, "lost at the end of a step")  # rebuilt on new weights
        every = self.cfg.checkpoint_every
        if self.cfg.checkpoint_dir and (self.m.version % every == 0 or self.m.done):
            from ray_xlong.cells import checkpoint

            checkpoint.save(self)

    def _push_weights(self) -> list[int]:
        """New weights to every engine not training (``CellJobConfig.weight_sync``); returns
        the cells whose runner (or the broadcast's sender) died."""
        g = self.learners
        targets = [c for c, role in enumerate(self.m.role)
                   if role is not Role.TRAINING and c not in self.retired]
        if self.sync is None:
            return self.pool.push_weights(targets, g.weights_ref, g.version)
        out = self.sync.push(self.pool, sender=g.lead, targets=targets, version=g.version,
                             weights_ref=g.weights_ref)
        if targets:
            self.stats["broadcast_fallbacks"].append(len(out.fallback))
        return list(out.lost)

    def _forget_trained(self, run_ids: Sequence[str]) -> None:
        """Runs of a finished step: drop their payload refs (the objects are freed) and their
        spool entries (now, or with the next checkpoint when checkpoints are on)."""
        for r in run_ids:
            self.held_runs.pop(r, None)
        self.spooled_trained.update(run_ids)
        if self.spool is not None and not self.cfg.checkpoint_dir:
            self.spool.discard(self.spooled_trained)
            self.spooled_trained.clear()

    def result(self) -> RayResult:
        """Measurements of the job so far (``metrics.job_result``)."""
        return job_result(self)
