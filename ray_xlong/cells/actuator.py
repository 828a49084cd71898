"""The Ray actuator: the simulator's twin that applies a policy's moves to real cells.

```
ray.wait(pending) ──► report to CellMachine ──► policy.decide(snapshot, event) ──► moves
   ▲   runs ended (runner.wait_ended)            (the same policy objects as the simulator)
   │   switch / sync done (actor refs)                          │ validated by the machine
   │   micro-batch done (learner.accumulate)                    ▼
   └──────────────────────────────────────────── act on cells:
        StartRuns          runner.start_runs(specs)           runs stay on their cell
        Drain              runner.drain()
        Reserve/Start/Join runner.suspend() → learner.wake_up(step state)   (switch)
        Sync               learner.sleep() → runner.resume(weights, version)  (sync)
     train: groups the step takes → chunk → micro-batches to awake members; when the step holds
            B groups and every micro-batch is done: reduce + one optimizer step, new weights to
            every engine not training (between requests), then ``end_step``.
```

Time is wall seconds since start (with the long-horizon job's ``time_scale = 1/3600`` one
second is one task hour, the unit of the simulator's log). A cell entering training or syncing
is busy (``ready_at = ∞``) until its actors report back, then ``ready`` is logged, as the
simulator logs the end of its switch / sync delay.

Invariants: every move passes the CellMachine first; a runner is suspended only after its runs
ended (the machine refuses otherwise, and the runner itself raises); every ended run is put in
exactly one chunk.

Faults (DESIGN.md 9, 10; ``benchmarks/faults.py``). A ref that fails because an actor died starts
:meth:`RayActuator._recover` for its cell:

* **runner lost** — a new runner in the cell's placement group on the current weights; runs that
  ended but were not delivered come from the spool (``spool.py``); the cell's live runs start
  again on it (``run_restarted``); its role (draining / asleep / syncing) is re-established.
* **learner lost** — a new learner; the micro-batches the dead one trained this step go back to
  the queue (``ElasticLearnerGroup.replace``), so the step's update is the same; a step member
  joins again on the step's weights.
* **node lost** — the cell's placement group lost its node: the cell is retired (its live runs
  restart on other cells, the scheduler goes on with fewer cells) and rebuilt once Ray re-places
  the group (resources returned).
* **driver lost** — with ``checkpoint_dir`` the driver saves the learner state (weights, Adam,
  version), the cell machine (ledger, event log), ended-but-untrained runs and trained-run ids at
  step boundaries; ``run(resume_from=...)`` in a new driver continues from it, taking runs that
  ended after the checkpoint from the spool and restarting the rest.

An actor error that is not a death, or a death with no recovery (the last cell), raises
:class:`CellActorDied` naming the cell.
"""

from __future__ import annotations

import collections
import os
import pathlib
import time
from typing import Any

import ray
import torch

from ray_xlong.cells.sharded import kill
from ray_xlong.cells.pool import CellPool
from ray_xlong.cells.config import CellJobConfig
from ray_xlong.cells.learner_group import (ElasticLearnerGroup, MicroBatch, StepIncomplete,
                                           actor_alive, actor_lost, chunk_with_stats)
from ray_xlong.cells.metrics import RayResult
from ray_xlong.cells.runs import run_index, run_key
from ray_xlong.cells.spool import RunSpool
from ray_xlong.scheduling import (CellMachine, Drain, Event, JoinStep, Policy, Reserve, Role,
                                  StartRuns, StartTraining, Sync)
from ray_xlong.trajectory.recording import read_runs, write_runs

INF = float("inf")
MAX_ROUNDS = 16
CHECKPOINT = "driver_checkpoint.pt"
"""File name of the driver checkpoint inside ``CellJobConfig.checkpoint_dir``."""
RUNNER_KINDS = ("ended", "started", "sync", "switch")  # pending kinds a runner death voids
LEARNER_KINDS = ("micro", "switch", "sync")  # pending kinds a learner death invalidates


class CellActorDied(RuntimeError):
    """A cell's runner or learner actor died (the message names the cell and the call)."""


class RayActuator:
    """Drives one job on a :class:`CellPool` with one policy (see module docstring)."""

    def __init__(self, config: CellJobConfig, policy: Policy, pool: CellPool) -> None:
        if len(pool.cells) != config.layout.cells:
            raise ValueError(f"RayActuator.pool: {len(pool.cells)} cells, config.layout "
                             f"wants {config.layout.cells}")
        self.cfg, self.policy, self.pool = config, policy, pool
        self.cells = pool.cells
        self.m = CellMachine(config.job, slots=[config.slots_per_cell] * len(self.cells))
        self.group: ElasticLearnerGroup | None = None  # built on the job's start state in run()
        self.pending: dict[Any, tuple[str, int, float]] = {}
        self.ended: dict[int, list] = collections.defaultdict(list)  # group -> AgentRuns
        self.queue: collections.deque[tuple[MicroBatch, bool]] = collections.deque()
        self.in_flight: dict[int, float] = {}  # cell -> dispatch time
        self.chain: dict[int, Any] = {}  # cell -> ref of its runner's last ordered call
        self.awake: set[int] = set()
        self.stats = collections.defaultdict(list)
        self.trained: dict[int, list[str]] = {}  # step -> run ids it trained
        self.token_staleness = 0
        self.t0 = time.monotonic()
        self.spool = RunSpool(config.spool_dir) if config.spool_dir else None
        self.unsaved: set[str] = set()  # delivered run ids not yet in a checkpoint
        self.faults: list[dict[str, Any]] = []  # one record per recovery
        self.retired: set[int] = set()
        self.resumed_at: float | None = None
        """Unix time a resume from a checkpoint finished (None: not resumed)."""
        self.injector: Any = None
        """Optional ``tick(actuator)`` called once per loop (``faults.FaultInjector``)."""

    def now(self) -> float:
        return time.monotonic() - self.t0

    # -- the loop ----------------------------------------------------------------------------
    def run(self, *, resume_from: str | os.PathLike | None = None) -> RayResult:
        """Run the job to its last step; returns the event log and measurements.

        Args:
            resume_from: a driver checkpoint (``CellJobConfig.checkpoint_dir`` / CHECKPOINT)
                written by an earlier driver of this job: continue from it.
        """
        if resume_from is not None:
            self._resume(resume_from)
        else:
            if self.spool is not None:  # runs of an earlier job or attempt are not ours
                self.spool.discard(self.spool.run_ids())
            self._reset_cells()
            self.t0 = time.monotonic()
            for c in range(len(self.cells)):
                self._watch_runs(c)
        self.act()
        while not self.m.done:
            if self.injector is not None:
                self.injector.tick(self)
            self.poll()
            self._check_retired()
            self.train()
            self.act()
        return self.result()

    def _reset_cells(self) -> None:
        """Every cell in rollout on version-0 weights, learners asleep on version-0 state."""
        state, weights = self.pool.initial_state, self.pool.initial_weights
        calls = []
        for cell in self.cells:
            calls.append(cell.learner.set_xlong_state.remote(state))
            calls.append(cell.learner.sleep.remote())
            calls.append(cell.runner.resume.remote(weights, 0))
        ray.get(calls)
        # The state lives in the driver's object store, so it outlives any node (durable).
        self.group = ElasticLearnerGroup([c.learner for c in self.cells], state=ray.get(state),
                                         durable=True)

    def _rcall(self, cell: int, method: str, *args: Any):
        """Call a role method of ``cell``'s runner after its previous one (Ray does not order
        the calls of an actor with concurrency groups: a ``drain`` sent after a
        ``start_runs`` could run first and make it refuse the runs)."""
        prev = self.chain.get(cell)
        ref = getattr(self.cells[cell].runner, method).remote(
            *args, *(() if prev is None else (prev,)))
        self.chain[cell] = ref
        return ref

    def _watch_runs(self, cell: int) -> None:
        ref = self.cells[cell].runner.wait_ended.remote(self.cfg.poll_s)
        self.pending[ref] = ("ended", cell, self.now())

    def poll(self) -> None:
        """Wait for at least one pending ref, handle every one that is ready."""
        refs = list(self.pending)
        ready, _ = ray.wait(refs, num_returns=1, timeout=self.cfg.poll_s)
        if ready:
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        for ref in ready:
            if ref not in self.pending:  # dropped by a recovery earlier in this loop
                continue
            kind, cell, issued = self.pending.pop(ref)
            try:
                value = ray.get(ref)
            except ray.exceptions.RayError as exc:
                if not actor_lost(exc):
                    raise CellActorDied(f"cell {cell}: {kind} failed: {exc}") from exc
                self._recover(cell, f"{kind} failed")
                continue
            getattr(self, f"_on_{kind}")(cell, value, issued)

    def _on_ended(self, cell: int, results: list, issued: float) -> None:
        self._deliver(cell, results)
        self._watch_runs(cell)

    def _deliver(self, cell: int, results: list) -> None:
        """Runs that ended on ``cell`` (from its runner or the spool), each taken once."""
        for res in results:
            run = run_index(res.run.run_id)
            if run not in self.m.live[cell]:  # delivered already (from the spool)
                continue
            self.m.run_ended(cell, run, self.now())
            self.ended[run // self.cfg.job.runs_per_group].append(res.run)
            self.unsaved.add(res.run.run_id)
        if self.spool is not None and not self.cfg.checkpoint_dir:
            self.spool.discard(self.unsaved)
            self.unsaved.clear()

    def _on_started(self, cell: int, value: Any, issued: float) -> None:
        """The runner took the runs (a refusal raised in ``poll`` instead)."""

    def _on_switch(self, cell: int, value: Any, issued: float) -> None:
        self.stats["switch_s"].append(self.now() - issued)
        if self.m.role[cell] is Role.SYNCING:  # sent back before its switch ended: the sync's
            return                            # end makes it ready (its learner sleeps again)
        self.awake.add(cell)
        self._ready(cell)

    def _on_sync(self, cell: int, value: Any, issued: float) -> None:
        self.stats["sync_s"].append(self.now() - issued)
        self._ready(cell)

    def _on_micro(self, cell: int, targets: int, issued: float) -> None:
        now = self.now()
        self.stats["micro_batch_s"].append(now - self.in_flight.pop(cell))
        self.stats["micro_batch_targets"].append(targets)
        self.m.log.append(Event(now, "micro_batch", cell=cell, step=self.m.step))

    def _ready(self, cell: int) -> None:
        now = self.now()
        self.m.busy_until(cell, now)
        self.m.cell_ready(cell, now)

    # -- deciding and acting -----------------------------------------------------------------
    def act(self) -> None:
        """Ask the policy until it has no more moves at this instant; apply each."""
        for _ in range(MAX_ROUNDS + 4 * len(self.cells)):
            now = self.now()
            moves = self.policy.decide(self.m.snapshot(now), self.m.log[-1])
            if not moves:
                return
            for move in moves:
                was_training = self.m.role[move.cell] is Role.TRAINING
                runs = self.m.apply(move, now)
                self._act(move, runs, was_training)
            self.train()
        raise RuntimeError(f"{self.policy.name}: still moving after many rounds at {self.now()}")

    def _act(self, move, runs: list[int], was_training: bool) -> None:
        cell, c = move.cell, self.cells[move.cell]
        if isinstance(move, StartRuns):
            g = self.cfg.job.runs_per_group
            ref = self._rcall(cell, "start_runs", [self.cfg.work.spec(r, runs_per_group=g)
                                                   for r in runs])
            self.pending[ref] = ("started", cell, self.now())  # a refusal fails loudly
        elif isinstance(move, Drain):
            self._rcall(cell, "drain")
        elif isinstance(move, (Reserve, StartTraining, JoinStep)):
            if isinstance(move, StartTraining):
                self.group.begin(move.step)
            after = None
            if not was_training:
                self.m.busy_until(cell, INF)
                after = self._rcall(cell, "suspend")
            if isinstance(move, Reserve):
                ref = c.learner.wake_up.remote(None, after)
            else:
                ref = self.group.join(cell, after=after)
            if not was_training:
                self.pending[ref] = ("switch", cell, self.now())
        elif isinstance(move, Sync):
            self.m.busy_until(cell, INF)
            self.awake.discard(cell)
            slept = self.group.sleep(cell)
            ref = self._rcall(cell, "resume", self.group.weights_ref, self.group.version, slept)
            self.pending[ref] = ("sync", cell, self.now())

    # -- training ------------------------------------------------------------------------------
    def train(self) -> None:
        """Chunk newly taken groups, feed awake members, finish a complete step."""
        groups = self.m.take_groups()
        if groups:
            runs = [run for g in groups for run in self.ended.pop(g)]
            micro, stats = chunk_with_stats(runs, processor=self.cfg.processor,
                                            max_tokens=self.cfg.learner.micro_batch_tokens)
            self.queue.extend((mb, i == 0) for i, mb in enumerate(micro))
            self.trained.setdefault(self.m.step, []).extend(r.run_id for r in runs)
            self._on_taken(micro, stats)
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
        members = [c for c in self.group.members if c in self.awake and c not in self.in_flight]
        for cell in members:
            if not self.queue:
                return
            micro, first = self.queue.popleft()
            versions = micro.tensors["policy_versions"]
            if versions.numel():
                self._on_staleness(self.m.step + self.version_offset - int(versions.min()))
            ref = self.group.submit(cell, micro, new_chunk=first)
            self.in_flight[cell] = self.now()
            self.pending[ref] = ("micro", cell, self.now())

    # Hooks for subclasses (``stepping.SteppingActuator``): the scheduler's step s trains
    # policy version ``s + version_offset``.
    version_offset = 0

    def _on_taken(self, micro: list, stats) -> None:
        """The current step took runs: their micro-batches and processor stats."""

    def _on_staleness(self, stale: int) -> None:
        """A micro-batch of the current step holds tokens ``stale`` versions old."""
        self.token_staleness = max(self.token_staleness, stale)

    def _finish_step(self) -> None:
        if not self.group.members:  # every member was lost; wait for one to (re)join
            return
        t = time.perf_counter()
        members = len(self.group.members)
        try:
            lost_after = self.group.finish()
        except StepIncomplete as inc:
            self._requeue(inc.redo)
            for cell in inc.lost:
                self._recover(cell, "lost during the step's reduce")
            return
        self.stats["step_members"].append(members)
        weights, version = self.group.weights_ref, self.group.version
        pushes = {c: self.cells[c].runner.set_weights.remote(weights, version)
                  for c, role in enumerate(self.m.role)
                  if role is not Role.TRAINING and c not in self.retired}
        failed = list(lost_after)
        for cell, ref in pushes.items():
            try:
                ray.get(ref)
            except ray.exceptions.RayError as exc:
                if not actor_lost(exc):
                    raise
                failed.append(cell)
        self.stats["step_finish_s"].append(time.perf_counter() - t)
        self.m.end_step(self.now())
        for cell in dict.fromkeys(failed):  # after end_step: the step is over for everyone
            self._recover(cell, "lost at the end of a step")  # rebuilt on the new weights
        every = self.cfg.checkpoint_every
        if self.cfg.checkpoint_dir and (self.m.version % every == 0 or self.m.done):
            self.save_checkpoint()

    # -- faults ----------------------------------------------------------------------------------
    def _drop_pending(self, cell: int, kinds: tuple[str, ...]) -> set[str]:
        """Forget pending refs of ``cell`` of these kinds (runs a ``wait_ended`` already
        returned are delivered first); returns the kinds dropped."""
        drop = [r for r, (k, c, _) in self.pending.items() if c == cell and k in kinds]
        ended = [r for r in drop if self.pending[r][0] == "ended"]
        if ended:
            ready, _ = ray.wait(ended, num_returns=len(ended), timeout=0)
            for ref in ready:
                try:
                    self._deliver(cell, ray.get(ref))
                except ray.exceptions.RayError as exc:
                    if not actor_lost(exc):
                        raise
        return {self.pending.pop(r)[0] for r in drop}

    def _recover(self, cell: int, why: str, *, attempt: int = 0) -> None:
        """An actor of ``cell`` died (module docstring): rebuild in place, or retire the cell
        when its placement group lost its node. A loss during the rebuild starts it again
        (three attempts, then the cell is retired)."""
        if cell in self.retired:
            return
        self.chain.pop(cell, None)  # a chained call on a dead actor's ref would fail forever
        if attempt >= 3:
            self._retire(cell, f"{why}; rebuild failed {attempt} times", time.perf_counter())
            return
        try:
            self._recover_once(cell, why)
        except ray.exceptions.RayError as exc:
            if not actor_lost(exc):
                raise
            self._recover(cell, f"{why}; lost again while rebuilding", attempt=attempt + 1)

    def _recover_once(self, cell: int, why: str) -> None:
        t0, now = time.perf_counter(), self.now()
        c = self.cells[cell]
        runner_dead = not actor_alive(c.runner)
        learner_dead = not actor_alive(c.learner)
        if not (runner_dead or learner_dead):
            # The failure came through a dependency (e.g. a switch whose suspend failed)
            # and Ray has not marked the actor yet: look again once.
            time.sleep(1.0)
            runner_dead, learner_dead = not actor_alive(c.runner), not actor_alive(c.learner)
            if not (runner_dead or learner_dead):
                raise CellActorDied(f"cell {cell}: {why}, but both actors are alive")
        if not self.pool.placed(cell):
            self._retire(cell, why, t0)
            return
        what = "both" if runner_dead and learner_dead else "runner" if runner_dead else "learner"
        self.m.cell_lost(cell, what, now)
        dropped = set()
        if runner_dead:
            dropped |= self._drop_pending(cell, RUNNER_KINDS)
        if learner_dead:
            dropped |= self._drop_pending(cell, LEARNER_KINDS)
        record = {"kind": what, "cell": cell, "why": why, "t": now, "runs_rerun": 0,
                  "runs_from_spool": 0, "micro_batches_redone": 0}
        try:
            if learner_dead:
                self._replace_learner(cell, record)
            if runner_dead:
                self._replace_runner(cell, record)
            self._restore_role(cell, dropped, runner_dead, learner_dead)
        except TimeoutError:  # the group lost its node while we rebuilt: retire instead
            self._retire(cell, why, t0)
            return
        self.m.log.append(Event(self.now(), "cell_rebuilt", cell=cell))
        record["recover_s"] = time.perf_counter() - t0
        self.faults.append(record)

    def _replace_learner(self, cell: int, record: dict) -> None:
        record["micro_batches_redone"] = len(self._requeue(self._new_learner(cell)))
        self.in_flight.pop(cell, None)
        self.awake.discard(cell)

    def _replace_runner(self, cell: int, record: dict) -> None:
        runner = self.pool.replace(cell, "runner")
        self.chain.pop(cell, None)
        ray.get(runner.resume.remote(self.group.weights_ref, self.group.version))
        record["runs_from_spool"], record["runs_rerun"] = self._take_over_runs(cell)

    def _take_over_runs(self, cell: int) -> tuple[int, int]:
        """A fresh runner on ``cell``: its live runs that ended into the spool are delivered,
        the others start again on it; it is watched. Returns (from the spool, restarted)."""
        spooled = self._spooled(cell)
        self._on_ended(cell, spooled, self.now())  # delivers, then watches the runner
        again = list(self.m.live[cell])
        if again:
            g = self.cfg.job.runs_per_group
            ray.get(self.cells[cell].runner.start_runs.remote(
                [self.cfg.work.spec(r, runs_per_group=g) for r in again]))
            for run in again:
                self.m.restart_run(cell, run, self.now())
        return len(spooled), len(again)

    def _spooled(self, cell: int) -> list:
        """Results in the spool of runs still live on ``cell`` (they ended, unreported)."""
        if self.spool is None or not self.m.live[cell]:
            return []
        return [res for _, res in self.spool.get(run_key(r) for r in self.m.live[cell]).values()]

    def _requeue(self, redo: list[MicroBatch]) -> list[MicroBatch]:
        """Put micro-batches a lost learner had trained back at the head of the queue (their
        chunk normalizers are already counted). Returns them."""
        self.queue.extendleft((mb, False) for mb in reversed(redo))
        return redo

    def _new_learner(self, cell: int, *, timeout_s: float = 120.0) -> list[MicroBatch]:
        """Start ``cell``'s learner again, asleep on the group's current state; returns the
        micro-batches the lost one had trained this step (to requeue)."""
        learner = self.pool.replace(cell, "learner", timeout_s=timeout_s)
        ray.get([learner.set_xlong_state.remote(self.group.state_ref), learner.sleep.remote()])
        redo = self.group.replace(cell, learner)
        self.group.learner_version[cell] = self.group.version
        return redo

    def _restore_role(self, cell: int, dropped: set[str], runner_new: bool,
                      learner_new: bool) -> None:
        """Put the cell's actors back into what its role expects (module docstring)."""
        c, role = self.cells[cell], self.m.role[cell]
        if role is Role.DRAINING and runner_new:
            self._rcall(cell, "drain")
        elif role is Role.TRAINING:
            after = self._rcall(cell, "suspend") if runner_new else None
            in_step = self.m.step >= 0 and self.m.step_of[cell] == self.m.step
            if "switch" in dropped or learner_new:
                self.in_flight.pop(cell, None)
                self.awake.discard(cell)
                if in_step:
                    if cell in self.group.members:
                        self._requeue(self.group.replace(cell, c.learner))
                    ref = self.group.join(cell, after=after)
                else:
                    ref = c.learner.wake_up.remote(self.group.state_ref, after)
                self.m.busy_until(cell, INF)
                self.pending[ref] = ("switch", cell, self.now())
        elif role is Role.SYNCING and ("sync" in dropped or runner_new):
            ref = self._rcall(cell, "resume", self.group.weights_ref, self.group.version)
            self.pending[ref] = ("sync", cell, self.now())

    def _retire(self, cell: int, why: str, t0: float) -> None:
        now = self.now()
        self.m.cell_lost(cell, "node", now)
        spooled = self._spooled(cell)
        self._deliver(cell, spooled)  # ended before the loss
        for actor in (self.cells[cell].runner, self.cells[cell].learner):
            kill(actor)  # a survivor on another node must not run on
        self.chain.pop(cell, None)
        try:
            orphans = self.m.retire_cell(cell, self.now())
        except Exception as exc:  # noqa: BLE001 - the last cell: nothing to continue on
            raise CellActorDied(f"cell {cell}: node lost ({why}) and it cannot retire: "
                                f"{exc}") from exc
        self._drop_pending(cell, RUNNER_KINDS + LEARNER_KINDS)
        redo = self._requeue(self.group.replace(cell, self.cells[cell].learner))
        self.in_flight.pop(cell, None)
        self.awake.discard(cell)
        self.retired.add(cell)
        self.faults.append({"kind": "node", "cell": cell, "why": why, "t": now,
                            "runs_rerun": len(orphans), "runs_from_spool": len(spooled),
                            "micro_batches_redone": len(redo),
                            "recover_s": time.perf_counter() - t0, "retired": True})

    def _check_retired(self) -> None:
        """Rebuild retired cells whose placement group Ray has placed again."""
        for cell in sorted(self.retired):
            if not self.pool.placed(cell):
                continue
            t0, start = time.perf_counter(), self.now()
            try:
                self._new_learner(cell, timeout_s=30.0)
                runner = self.pool.replace(cell, "runner", timeout_s=30.0)
                self.chain.pop(cell, None)
            except TimeoutError:
                continue
            ray.get(runner.resume.remote(self.group.weights_ref, self.group.version))
            self.retired.discard(cell)
            self.m.rebuild_cell(cell, self.now())
            self._watch_runs(cell)
            self.faults.append({"kind": "node_returned", "cell": cell, "t": start,
                                "runs_rerun": 0, "runs_from_spool": 0,
                                "micro_batches_redone": 0,
                                "recover_s": time.perf_counter() - t0})

    # -- driver checkpoints ------------------------------------------------------------------------
    def save_checkpoint(self) -> pathlib.Path:
        """Write the driver checkpoint (module docstring) atomically; returns its path."""
        root = pathlib.Path(self.cfg.checkpoint_dir)
        root.mkdir(parents=True, exist_ok=True)
        version = self.m.version
        runs = root / f"ended-v{version}.jsonl.gz"  # recording format: contexts as deltas
        write_runs(str(runs), [r for g in sorted(self.ended) for r in self.ended[g]])
        state = {
            "format": 1, "mode": self.policy.name, "job": self.cfg.job,
            "time": self.now(), "machine": self.m, "policy": self.policy,
            "ended_runs": runs.name, "trained": self.trained,
            "learner": ray.get(self.group.state_ref),
            "token_staleness": self.token_staleness,
            "stats": dict(self.stats), "faults": self.faults,
        }
        path, tmp = root / CHECKPOINT, root / f".{CHECKPOINT}.tmp"
        torch.save(state, tmp)
        os.replace(tmp, path)
        for old in root.glob("ended-v*.jsonl.gz"):
            if old.name != runs.name:
                old.unlink(missing_ok=True)
        if self.spool is not None:
            self.spool.discard(self.unsaved)
        self.unsaved.clear()
        return path

    def _resume(self, path: str | os.PathLike) -> None:
        """Load a driver checkpoint into this (new) driver and its fresh cells."""
        state = torch.load(path, weights_only=False)
        if state.get("format") != 1 or state["job"] != self.cfg.job:
            raise ValueError(f"RayActuator.resume_from: {path} is not a checkpoint of this job "
                             f"({state.get('job')} vs {self.cfg.job})")
        self.m, self.policy = state["machine"], state["policy"]
        self.ended = collections.defaultdict(list)
        g = self.cfg.job.runs_per_group
        for run in read_runs(str(pathlib.Path(path).parent / state["ended_runs"])):
            self.ended[run_index(run.run_id) // g].append(run)
        self.trained = state["trained"]
        self.token_staleness = state["token_staleness"]
        self.stats = collections.defaultdict(list, state["stats"])
        self.faults = list(state["faults"])
        learner_state = state["learner"]
        version = int(learner_state["version"])
        calls = []
        for cell in self.cells:
            calls += [cell.learner.set_xlong_state.remote(learner_state),
                      cell.learner.sleep.remote()]
        ray.get(calls)
        self.group = ElasticLearnerGroup([c.learner for c in self.cells], state=learner_state,
                                         durable=True)
        ray.get([c.runner.resume.remote(self.group.weights_ref, version) for c in self.cells])
        self.t0 = time.monotonic() - float(state["time"])
        self.m.resume(self.now())  # the runs it still owes stay live on their cells
        from_spool = rerun = 0
        for cell in range(len(self.cells)):
            spooled, again = self._take_over_runs(cell)
            from_spool, rerun = from_spool + spooled, rerun + again
            if self.m.role[cell] is Role.DRAINING:
                self._rcall(cell, "drain")
        if self.spool is not None:  # results of runs started after the checkpoint: re-run
            known = {r.run_id for runs in self.ended.values() for r in runs}
            known |= {r for ids in self.trained.values() for r in ids}
            self.spool.discard(self.spool.run_ids() - known - self.unsaved)
        self.resumed_at = time.time()
        self.faults.append({"kind": "driver", "cell": -1, "t": self.now(), "runs_rerun": rerun,
                            "runs_from_spool": from_spool, "micro_batches_redone": 0,
                            "recover_s": 0.0})

    def result(self) -> RayResult:
        """Measurements of the finished job."""
        led = self.m.ledger
        return RayResult(
            mode=self.policy.name, makespan_s=self.now(), cells=len(self.cells),
            slots_per_cell=self.cfg.slots_per_cell,
            staleness=tuple(s - v for s, v in zip(led.trained_step, led.group_version)),
            token_staleness_max=self.token_staleness, trained_step=tuple(led.trained_step),
            trained_runs=tuple(tuple(self.trained.get(s, ())) for s in range(self.m.version)),
            events=tuple(self.m.log), timings={k: tuple(v) for k, v in self.stats.items()},
            placement_groups_created=self.pool.placement_groups_created,
            faults=tuple(self.faults))
