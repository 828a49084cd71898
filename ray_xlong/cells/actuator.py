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
ended; every ended run is in exactly one micro-batch plan. The actuator owns the job's state
(``job_state.JobState``); losses go to ``recovery.py``, driver checkpoints to ``checkpoint.py``,
measurements to ``metrics.py``: each takes that state (and the actuator's few actions,
``protocols.JobActions``), none imports this module. Ray is reached through ``JobState.ray``
(``ray_edge.RayEdge``; an in-process fake in unit tests) and actor handles. An actor error that
is not a death raises ``CellActorDied``.
"""

from __future__ import annotations

import os
import time
from typing import Any, Sequence

from ray_xlong.cells import checkpoint
from ray_xlong.cells.broadcast import broadcast_sync
from ray_xlong.cells.collectives import transfer_broke
from ray_xlong.cells.config import CellJobConfig
from ray_xlong.cells.eval_runs import EvalRuns
from ray_xlong.cells.job_state import INF, JobState
from ray_xlong.cells.learner_group import (ElasticLearnerGroup, MicroBatch, StepIncomplete,
                                           plan_step)
from ray_xlong.cells.metrics import RayResult, job_result
from ray_xlong.cells.protocols import CellHost
from ray_xlong.cells.ray_edge import RayCalls, RayEdge
from ray_xlong.cells.records import CellActorDied, EndedRun, FaultRecord, Pending, StepObserver
from ray_xlong.cells.recovery import Recovery
from ray_xlong.cells.runs import run_index
from ray_xlong.cells.spool import RunSpool
from ray_xlong.scheduling import (CellMachine, Drain, JoinStep, Policy, Reserve, Role, StartRuns,
                                  StartTraining, Sync)
from ray_xlong.trajectory.per_run import RunDigest

__all__ = ["CellActorDied", "EndedRun", "INF", "Pending", "RayActuator", "StepObserver"]
MAX_ROUNDS = 16


class RayActuator:
    """Drives one job on a :class:`CellPool` with one policy (see module docstring).

    Args:
        config: the job.
        policy: the scheduling policy (the simulator's objects).
        pool: the cells.
        version_offset: the policy version of scheduler step 0 (a job restored at version v).
        observer: told about runs and steps as they happen (:class:`StepObserver`).
        ray: the Ray calls (default ``ray_edge.RayEdge``; ``tests/cells/fakes.FakeRay`` with a
            fake pool runs the job in process).
    """

    def __init__(self, config: CellJobConfig, policy: Policy, pool: CellHost, *,
                 version_offset: int = 0, observer: StepObserver | None = None,
                 ray: RayCalls | None = None) -> None:
        if len(pool.cells) != config.layout.cells:
            raise ValueError(f"RayActuator.pool: {len(pool.cells)} cells, config.layout "
                             f"wants {config.layout.cells}")
        self.state = JobState(
            config, policy, pool, ray if ray is not None else RayEdge(),
            CellMachine(config.job, slots=[config.slots_per_cell] * len(pool.cells)),
            version_offset=version_offset, observer=observer,
            spool=RunSpool(config.spool_dir) if config.spool_dir else None)
        """The job's state (``job_state.JobState``): what recovery, checkpoints and metrics take."""
        self.recovery = Recovery(self.state, self)
        self.injector: Any = None
        """Optional ``tick(actuator)`` called once per loop (``faults.FaultInjector``)."""
        self.sync = broadcast_sync(config)  # BroadcastWeights, or None: the object store
        self.evals = EvalRuns()
        """Evaluation runs on rollout cells (``eval_runs.py``); never trained."""
        self.hold_step_finish = False
        """While True a complete step is not applied (its micro-batches still train): set by
        an evaluation that ticks the loop while it waits for its round's last runs."""

    def now(self) -> float:
        return self.state.now()

    # -- the job's state, read by drivers, tools and tests ----------------------------------
    @property
    def cfg(self) -> CellJobConfig:
        return self.state.cfg

    @property
    def pool(self) -> CellHost:
        return self.state.pool

    @property
    def cells(self) -> list[Any]:
        return self.state.cells

    @property
    def m(self) -> CellMachine:
        """The cell machine (roles, live runs, ledger, event log ``m.log``)."""
        return self.state.m

    @property
    def learners(self) -> ElasticLearnerGroup | None:
        return self.state.learners

    @property
    def in_flight(self) -> dict[int, float]:
        """Cells mid micro-batch → dispatch time."""
        return self.state.in_flight

    @property
    def stats(self) -> dict[str, list[float]]:
        return self.state.stats

    @property
    def trained(self) -> dict[int, list[str]]:
        """Step → run ids it trained."""
        return self.state.trained

    @property
    def resumed_at(self) -> float | None:
        """Unix time a resume from a checkpoint finished (None: not resumed)."""
        return self.state.resumed_at

    @property
    def faults(self) -> list[FaultRecord]:
        """One record per recovery so far (``RayResult.faults``)."""
        return self.state.faults

    @property
    def retired(self) -> set[int]:
        """Cells whose node was lost and that are not rebuilt yet."""
        return self.state.retired

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
        s = self.state
        if s.cfg.checkpoint_dir:
            checkpoint.check_dir(s.cfg.checkpoint_dir)  # before any step, naming the path
        if resume_from is not None:
            checkpoint.resume(s, resume_from, recovery=self.recovery, actions=self)
        else:
            if s.spool is not None:  # runs of an earlier job or attempt are not ours
                s.spool.discard(s.spool.run_ids())
            self.start(self.pool.initial_state, self.pool.initial_weights)
            if s.cfg.checkpoint_dir:   # the starting state is the first checkpoint: a state
                checkpoint.save(s)     # lost before the first step's save completes reloads it
        self.act()
        while not self.m.done:
            self.tick()
        return self.result()

    def start(self, state: Any, weights: Any) -> None:
        """Every cell in rollout on ``weights``, learners asleep on ``state`` (refs of the
        learner state / weights the job starts from); runs are watched from now on."""
        s = self.state
        version = s.version_offset
        calls = []
        for cell in s.cells:
            calls += [cell.learner.set_xlong_state.remote(state), cell.learner.sleep.remote(),
                      cell.runner.resume.remote(weights, version)]
        s.ray.get(calls)
        # The driver keeps the ref only: the state lives on the learners (every one loaded it).
        s.learners = ElasticLearnerGroup(
            [c.learner for c in s.cells], state=state, version=version, ray=s.ray,
            state_source=self.recovery.state_source)
        s.t0 = time.monotonic()
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
        self.place_eval()

    def rcall(self, cell: int, method: str, *args: Any):
        """Call a role method of ``cell``'s runner after its previous one (Ray does not order
        the calls of an actor with concurrency groups: a ``drain`` sent after a
        ``start_runs`` could run first and make it refuse the runs)."""
        chain = self.state.chain
        prev = chain.get(cell)
        ref = getattr(self.cells[cell].runner, method).remote(
            *args, *(() if prev is None else (prev,)))
        chain[cell] = ref
        return ref

    def watch_runs(self, cell: int) -> None:
        """Ask ``cell``'s runner for the runs that end next (digests + a payload ref)."""
        digests, payload = self.cells[cell].runner.wait_ended.remote(self.cfg.poll_s)
        self.state.pending[digests] = Pending("ended", cell, self.now(), payload)

    def poll(self) -> None:
        """Wait for at least one pending ref, handle every one that is ready."""
        s = self.state
        refs = list(s.pending)
        ready, _ = s.ray.wait(refs, num_returns=1, timeout=self.cfg.poll_s)
        if ready:
            ready, _ = s.ray.wait(refs, num_returns=len(refs), timeout=0)
        for ref in ready:
            p = s.pending.pop(ref, None)
            if p is None:  # dropped by a recovery earlier in this loop
                continue
            try:
                value = s.ray.get(ref)
            except s.ray.Error as exc:
                if p.kind in ("switch", "load"):  # its Learner did not load the step's state
                    s.learners.wake_failed(p.cell)
                    broke = transfer_broke(exc)
                    if broke or (s.ray.lost(exc) and s.ray.alive(self.cells[p.cell].learner)
                                 and s.ray.alive(self.cells[p.cell].runner)):
                        # a holder's end of the transfer, or the object-store copy it loaded,
                        # went with a node
                        self.recovery.switch_failed(p.cell, str(exc), copies_lost=not broke)
                        continue
                if not s.ray.lost(exc):
                    raise CellActorDied(f"cell {p.cell}: {p.kind} failed: {exc}") from exc
                if p.kind == "eval":  # recovered through the runner's other refs; its
                    continue          # evaluation runs are queued again (place_eval)
                if p.kind == "micro" and s.ray.alive(self.cells[p.cell].learner):
                    self._train_again(p.cell)  # its runs' payload went with a node
                    continue
                self.recovery.recover(p.cell, f"{p.kind} failed", failed=p.kind)
                continue
            getattr(self, f"_on_{p.kind}")(p, value)

    def _on_ended(self, p: Pending, digests: list[RunDigest]) -> None:
        self.deliver(p.cell, digests, p.payload)
        self.watch_runs(p.cell)
        if self.evals.live_on(p.cell):  # evaluation runs end there too: ask for them
            ref = self.cells[p.cell].runner.take_eval.remote()
            self.state.pending[ref] = Pending("eval", p.cell, self.now())

    def _on_eval(self, p: Pending, report: Any) -> None:
        self.evals.report(p.cell, report)

    # -- evaluation runs (eval_runs.py) ------------------------------------------------------
    def place_eval(self) -> None:
        """Queued evaluation runs to cells in rollout (ready, not retired), at most
        ``slots_per_cell`` live on a cell; live ones of a replaced or retired runner are
        queued again first."""
        s, ev = self.state, self.evals
        for cell in ev.cells():
            if cell in s.retired or ev.runner(cell) is not self.cells[cell].runner:
                ev.lost(cell)
        if not ev.queue:
            return
        for cell, role in enumerate(s.m.role):
            if role is not Role.ROLLOUT or s.m.ready_at[cell] == INF or cell in s.retired:
                continue
            specs = ev.take_queued(cell, self.cfg.slots_per_cell - ev.live_on(cell))
            if specs:
                ev.placed(cell, specs, runner=self.cells[cell].runner, role=role.value)
                ref = self.rcall(cell, "start_eval_runs", specs)
                s.pending[ref] = Pending("started", cell, self.now())

    def deliver(self, cell: int, digests: Sequence[RunDigest], payload: Any, *,
                payload_cell: int | None = None) -> None:
        """Runs that ended on ``cell``, each taken once; ``payload``: the ref of their
        episodes, processed on ``payload_cell`` (default: ``cell``)."""
        s, where = self.state, cell if payload_cell is None else payload_cell
        for d in digests:
            run = run_index(d.run_id)
            if run not in s.m.live[cell]:  # delivered already (from the spool)
                continue
            s.m.run_ended(cell, run, s.now())
            ended = EndedRun(d, payload, where)
            s.ended[run // s.cfg.job.runs_per_group].append(ended)
            s.held_runs[d.run_id] = ended
            if s.observer is not None:
                s.observer.delivered(d)

    def _on_started(self, p: Pending, value: Any) -> None:  # a refusal raised in ``poll``
        pass

    def _on_switch(self, p: Pending, value: Any) -> None:
        self.state.learners.woke(p.cell)      # the state it was sent (if any) loaded
        self.stats["switch_s"].append(self.now() - p.issued)
        if self.m.role[p.cell] is Role.SYNCING:  # sent back before its switch ended: the
            return                              # sync's end makes it ready
        self.state.awake.add(p.cell)
        self.ready(p.cell)

    def _on_load(self, p: Pending, value: Any) -> None:
        self.state.learners.woke(p.cell)      # the step's state loaded: it takes micro-batches
        self.state.awake.add(p.cell)

    def _on_sync(self, p: Pending, value: Any) -> None:
        s = self.state
        if p.version < s.learners.version:
            # A step ended during the sync. Its push (``set_weights``) to this runner may have
            # run before the sync's ``resume``, which waited for the Learner's sleep: Ray does
            # not order the calls of an actor with concurrency groups, so the engine may hold
            # the older weights. Send the current ones (chained after that ``resume``) before
            # the cell takes runs stamped with the current version.
            ref = self.rcall(p.cell, "resume", s.learners.weights_ref, s.learners.version)
            s.pending[ref] = Pending("sync", p.cell, p.issued, version=s.learners.version)
            return
        self.stats["sync_s"].append(self.now() - p.issued)
        self.ready(p.cell)

    def _on_micro(self, p: Pending, targets: int) -> None:
        now = self.now()
        self.stats["micro_batch_s"].append(now - self.state.in_flight.pop(p.cell))
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

        self.m.settle(self.state.policy, self.now, apply=apply, after_round=self.train,
                      max_rounds=MAX_ROUNDS + 4 * len(self.cells))

    def _act(self, move, runs: list[int], was_training: bool) -> None:
        s, cell, c = self.state, move.cell, self.cells[move.cell]
        if isinstance(move, StartRuns):
            g = self.cfg.job.runs_per_group
            ref = self.rcall(cell, "start_runs", [self.cfg.work.spec(r, runs_per_group=g)
                                                  for r in runs])
            s.pending[ref] = Pending("started", cell, self.now())  # a refusal fails loudly
        elif isinstance(move, Drain):
            self.rcall(cell, "drain")
        elif isinstance(move, (Reserve, StartTraining, JoinStep)):
            if isinstance(move, StartTraining):
                s.learners.begin(move.step + s.version_offset)
            after = None
            if not was_training:
                self.m.busy_until(cell, INF)
                after = self.rcall(cell, "suspend")
            if isinstance(move, Reserve):
                ref = c.learner.wake_up.remote(None, after)
            else:
                ref = s.learners.join(cell, after=after)
            if not was_training:
                s.pending[ref] = Pending("switch", cell, self.now())
            elif s.learners.brings_state(cell):
                # awake (reserved) but behind: no micro-batch before the state loaded, and a
                # load that fails (its holder's node lost mid-transfer) is recovered like a
                # switch's
                s.awake.discard(cell)
                s.pending[ref] = Pending("load", cell, self.now())
        elif isinstance(move, Sync):
            self.m.busy_until(cell, INF)
            s.awake.discard(cell)
            slept = s.learners.sleep(cell)
            ref = self.rcall(cell, "resume", s.learners.weights_ref, s.learners.version, slept)
            s.pending[ref] = Pending("sync", cell, self.now(), version=s.learners.version)

    # -- training ------------------------------------------------------------------------------
    def train(self) -> None:
        """Plan newly taken groups, feed awake members, finish a complete step."""
        s = self.state
        groups = s.m.take_groups()
        if groups:
            ended = [e for g in groups for e in s.ended.pop(g)]
            micro, stats = plan_step([e.digest for e in ended], processor=s.cfg.processor,
                                     max_tokens=s.cfg.learner.micro_batch_tokens)
            s.queue.extend((mb, False) for mb in micro)
            s.trained.setdefault(s.m.step, []).extend(e.digest.run_id for e in ended)
            if s.observer is not None:
                s.observer.taken(s.m.step, micro, stats)
        if s.m.step < 0:
            return
        self._dispatch()
        if s.queue or s.in_flight:
            s.m.set_starved(False, s.now())
        elif s.m.step_groups == s.cfg.job.batch_groups:
            if not self.hold_step_finish:
                self._finish_step()
        else:
            s.m.set_starved(True, s.now())

    def _dispatch(self) -> None:
        s = self.state
        members = [c for c in s.learners.members if c in s.awake and c not in s.in_flight]
        for cell in members:
            if not s.queue:
                return
            micro, counted = s.queue.popleft()
            if micro.min_version >= 0:
                stale = s.m.step + s.version_offset - micro.min_version
                s.token_staleness = max(s.token_staleness, stale)
                if s.observer is not None:
                    s.observer.staleness(s.m.step, stale)
            payloads = list(dict.fromkeys(s.held_runs[r].payload for r in micro.run_ids))
            ref = s.learners.submit(cell, micro, payloads=payloads, counted=counted)
            s.in_flight[cell] = s.now()
            s.pending[ref] = Pending("micro", cell, s.now())

    def requeue(self, redo: list[MicroBatch]) -> list[MicroBatch]:
        """Put micro-batches a lost learner had trained back at the head of the queue (their
        weights are already counted). Returns them."""
        self.state.queue.extendleft((mb, True) for mb in reversed(redo))
        return redo

    def _train_again(self, cell: int) -> None:
        """``cell``'s micro-batch failed because its runs' payload was lost (with a node):
        queue it again; the recovery of that node rebuilds the payload from the spool."""
        self.state.in_flight.pop(cell, None)
        self.requeue([self.state.learners.take_back(cell)])

    def _finish_step(self) -> None:
        s = self.state
        if not s.learners.members:  # every member was lost; wait for one to (re)join
            return
        t = time.perf_counter()
        members = len(s.learners.members)
        try:
            lost_after = s.learners.finish()
        except StepIncomplete as inc:
            self.requeue(inc.redo)
            for cell in inc.lost:
                self.recovery.recover(cell, "lost during the step's reduce")
            return
        s.stats["step_members"].append(members)
        failed = list(lost_after) + self._push_weights()
        s.stats["step_finish_s"].append(time.perf_counter() - t)
        self._forget_trained(s.trained.get(s.m.step, []))
        s.m.end_step(s.now())
        for cell in dict.fromkeys(failed):  # after end_step: the step is over for everyone
            c = s.cells[cell]
            if s.ray.alive(c.runner) and s.ray.alive(c.learner):
                # its new weights were lost with another node (the copy's maker), not the
                # cell: its engine holds old weights, so it is rebuilt like a lost one
                s.ray.kill(c.runner)
            self.recovery.recover(cell, "lost at the end of a step")  # rebuilt on new weights
        every = s.cfg.checkpoint_every
        if s.cfg.checkpoint_dir and (s.m.version % every == 0 or s.m.done):
            checkpoint.save(s, final=s.m.done)

    def _push_weights(self) -> list[int]:
        """New weights to every engine not training (``CellJobConfig.weight_sync``); returns
        the cells whose runner (or the broadcast's sender) died."""
        s, g = self.state, self.state.learners
        targets = [c for c, role in enumerate(s.m.role)
                   if role is not Role.TRAINING and c not in s.retired]
        if self.sync is None:
            return s.pool.push_weights(targets, g.weights_ref, g.version)
        out = self.sync.push(s.pool, sender=g.lead, targets=targets, version=g.version,
                             weights_ref=g.weights_ref)
        if targets:
            s.stats["broadcast_fallbacks"].append(len(out.fallback))
        return list(out.lost)

    def _forget_trained(self, run_ids: Sequence[str]) -> None:
        """Runs of a finished step: drop their payload refs (the objects are freed) and their
        spool entries (now, or with the next checkpoint when checkpoints are on)."""
        s = self.state
        for r in run_ids:
            s.held_runs.pop(r, None)
        s.spooled_trained.update(run_ids)
        if s.spool is not None and not s.cfg.checkpoint_dir:
            s.spool.discard(s.spooled_trained)
            s.spooled_trained.clear()

    def result(self) -> RayResult:
        """Measurements of the job so far (``metrics.job_result``)."""
        return job_result(self.state)
