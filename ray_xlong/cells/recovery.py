"""Recovery of a job on cells from actor and node loss (docs/design.md invariant 9), apart from the
actuator's loop: the actuator owns the job state (``job_state.JobState``), :class:`Recovery`
rebuilds it after a loss, asking the actuator only for its few actions (``protocols.JobActions``)
and Ray only through ``JobState.ray`` (so a fake runs it without Ray).

```
a pending ref failed because an actor died ─► recover(cell)
  runner lost    new runner in the cell's placement group on the current weights; its runs that
                 ended into the spool are processed from there, the others start again on it;
                 its role (draining / asleep / syncing) is re-established
  learner lost   new learner; the micro-batches the dead one trained this step go back to the
                 queue (ElasticLearnerGroup.replace): the step's update stays the same
  node lost      the placement group lost its node: the cell is retired (its live runs restart
                 on other cells; payloads of its ended, untrained runs are rebuilt from the
                 spool by another runner) and rebuilt once Ray re-places the group
  state lost     every holder of the current state is gone (the last step's members: each
                 applied the same update; the driver holds refs only, and the group's
                 object-store copy, if any, is of an older version): a live Learner loads the
                 last completed checkpoint (``checkpoint.py``) and replays the steps since
                 from the spool — the step
                 records name the runs each step trained, in order, and their advantages come
                 from the same digests — so the state is the one lost (to float tolerance:
                 only the order of additions differs), nothing lost, nothing trained twice
```

An actor error that is not a death, or a death with no recovery (the last cell, or runs whose
payload is gone without a spool), raises :class:`~ray_xlong.cells.records.CellActorDied`.
"""

from __future__ import annotations

import time
from typing import Any

from ray_xlong.cells.job_state import INF, JobState
from ray_xlong.cells.learner_group import MicroBatch, plan_step
from ray_xlong.cells.protocols import JobActions
from ray_xlong.cells.records import CellActorDied, EndedRun, FaultRecord, Pending
from ray_xlong.cells.runs import run_key
from ray_xlong.cells.shard_checkpoint import latest
from ray_xlong.scheduling import Event, Role

RUNNER_KINDS = ("ended", "started", "sync", "switch")  # pending kinds a runner death voids
LEARNER_KINDS = ("micro", "switch", "load", "sync")  # pending kinds a learner death voids
REBUILD_TRIES = 3  # a returned node's cell whose state load is lost this often fails the job


class Recovery:
    """Rebuilds a job's cells after a loss (module docstring); records each recovery in
    ``JobState.faults``.

    Args:
        state: the job's state (changed in place).
        actions: the actuator's actions (deliver, requeue, rcall, watch_runs).
    """

    def __init__(self, state: JobState, actions: JobActions) -> None:
        self.state, self.actions = state, actions
        self.lost_rebuilds: dict[int, int] = {}
        """Per retired cell, rebuilds whose state load was lost (:meth:`check_retired`)."""

    @property
    def records(self) -> list[FaultRecord]:
        """One record per recovery (``JobState.faults``)."""
        return self.state.faults

    @property
    def retired(self) -> set[int]:
        """Cells whose node was lost, not yet rebuilt (``JobState.retired``)."""
        return self.state.retired

    def _record(self, kind: str, cell: int, t: float, t0: float, *, why: str = "",
                rerun: int = 0, from_spool: int = 0, redone: int = 0,
                retired: bool = False) -> None:
        self.state.faults.append(FaultRecord(kind, cell, why, t, time.perf_counter() - t0,
                                             runs_rerun=rerun, runs_from_spool=from_spool,
                                             micro_batches_redone=redone, retired=retired))

    def drop_pending(self, cell: int, kinds: tuple[str, ...]) -> set[str]:
        """Forget pending refs of ``cell`` of these kinds (runs a ``wait_ended`` already
        returned are delivered first); returns the kinds dropped."""
        s = self.state
        drop = [r for r, p in s.pending.items() if p.cell == cell and p.kind in kinds]
        ended = [r for r in drop if s.pending[r].kind == "ended"]
        if ended:
            ready, _ = s.ray.wait(ended, num_returns=len(ended), timeout=0)
            for ref in ready:
                try:
                    self.actions.deliver(cell, s.ray.get(ref), s.pending[ref].payload)
                except s.ray.Error as exc:
                    if not s.ray.lost(exc):
                        raise
        return {s.pending.pop(r).kind for r in drop}

    def recover(self, cell: int, why: str, *, attempt: int = 0, failed: str | None = None,
                transfer: bool = False) -> None:
        """An actor of ``cell`` died: rebuild in place, or retire the cell when its placement
        group lost its node. A loss during the rebuild starts it again (three attempts, then
        the cell is retired). ``failed``: the kind of the call whose failure told (taken off
        the pending calls already: redone like the ones the death voids). ``transfer``: the
        Learner was stopped because its state did not arrive (recorded as ``transfer`` when
        nothing else died)."""
        s = self.state
        if cell in s.retired:
            return
        s.chain.pop(cell, None)  # a chained call on a dead actor's ref fails forever
        if attempt >= 3:
            self.retire(cell, f"{why}; rebuild failed {attempt} times", time.perf_counter())
            return
        try:
            self._recover_once(cell, why, failed, transfer)
        except s.ray.Error as exc:
            if not s.ray.lost(exc):
                raise
            self.recover(cell, f"{why}; lost again while rebuilding", attempt=attempt + 1,
                         failed=failed, transfer=transfer)

    def switch_failed(self, cell: int, why: str, *, copies_lost: bool) -> None:
        """``cell``'s Learner woke up to join a step, but the state it was to load never arrived
        whole: a holder's end of the peer transfer was lost mid-way, or (``copies_lost``) the
        object-store copy it loaded went with a node. The Learner is stopped — a sharded cell's
        ranks may differ in what they loaded — and rebuilt on the state of a live holder, or the
        last checkpoint, as when a Learner dies (the driver goes on)."""
        s = self.state
        s.learners.transfer_failed(cell)
        if copies_lost:
            s.learners.forget_copies()
        s.ray.kill(s.cells[cell].learner)
        self.recover(cell, f"switch failed: its state did not arrive ({why})", failed="switch",
                     transfer=True)

    def _dead(self, cell: int, why: str) -> tuple[bool, bool]:
        """(runner dead, learner dead); looks twice, since a failure that came through a
        dependency may arrive before Ray marks the actor."""
        s = self.state
        c = s.cells[cell]
        for look in range(2):
            runner_dead, learner_dead = not s.ray.alive(c.runner), not s.ray.alive(c.learner)
            if runner_dead or learner_dead:
                return runner_dead, learner_dead
            if look == 0:
                time.sleep(1.0)
        raise CellActorDied(f"cell {cell}: {why}, but both actors are alive")

    def _recover_once(self, cell: int, why: str, failed: str | None = None,
                      transfer: bool = False) -> None:
        s = self.state
        t0, now = time.perf_counter(), s.now()
        runner_dead, learner_dead = self._dead(cell, why)
        if not s.pool.placed(cell):
            self.retire(cell, why, t0)
            return
        what = "both" if runner_dead and learner_dead else "runner" if runner_dead else "learner"
        s.m.cell_lost(cell, what, now)
        dropped = {failed} if failed else set()
        if runner_dead:
            dropped |= self.drop_pending(cell, RUNNER_KINDS)
        if learner_dead:
            dropped |= self.drop_pending(cell, LEARNER_KINDS)
        redone = from_spool = rerun = 0
        try:
            if learner_dead:
                redone = len(self.actions.requeue(self.new_learner(cell)))
                s.in_flight.pop(cell, None)
                s.awake.discard(cell)
            if runner_dead:
                runner = s.pool.replace(cell, "runner")
                s.chain.pop(cell, None)
                s.ray.get(runner.resume.remote(s.learners.weights_ref, s.learners.version))
                from_spool, rerun = self.take_over_runs(cell)
            self._restore_role(cell, dropped, runner_dead, learner_dead)
        except TimeoutError:  # the group lost its node while we rebuilt: retire instead
            self.retire(cell, why, t0)
            return
        s.m.log.append(Event(s.now(), "cell_rebuilt", cell=cell))
        self._record("transfer" if transfer and what == "learner" else what, cell, now, t0,
                     why=why, rerun=rerun, from_spool=from_spool, redone=redone)

    def take_over_runs(self, cell: int) -> tuple[int, int]:
        """A fresh runner on ``cell``: its live runs that ended into the spool are delivered
        (processed by that runner), the others start again on it; it is watched. Returns
        (from the spool, restarted)."""
        s = self.state
        spooled = self.from_spool(cell, s.cells[cell].runner, payload_cell=cell)
        self.actions.watch_runs(cell)
        again = list(s.m.live[cell])
        if again:
            g = s.cfg.job.runs_per_group
            s.ray.get(s.cells[cell].runner.start_runs.remote(
                [s.cfg.work.spec(r, runs_per_group=g) for r in again]))
            for run in again:
                s.m.restart_run(cell, run, s.now())
        return spooled, len(again)

    def from_spool(self, cell: int, runner: Any, *, payload_cell: int) -> int:
        """Deliver the runs still live on ``cell`` that ended into the spool (they ended,
        unreported), processed by ``runner`` (of ``payload_cell``). Returns how many."""
        s = self.state
        if s.spool is None or not s.m.live[cell]:
            return 0
        ids = sorted({run_key(r) for r in s.m.live[cell]} & s.spool.run_ids())
        if not ids:
            return 0
        digests, payload = runner.process_spooled.remote(ids)
        self.actions.deliver(cell, s.ray.get(digests), payload, payload_cell=payload_cell)
        return len(ids)

    def new_learner(self, cell: int, *, timeout_s: float = 120.0) -> list[MicroBatch]:
        """Start ``cell``'s learner again, asleep on the group's current state; returns the
        micro-batches the lost one had trained this step (to requeue)."""
        s = self.state
        learner = s.pool.replace(cell, "learner", timeout_s=timeout_s)
        for tries in range(len(s.cells), -1, -1):
            if self.state_lost():
                self.reload_checkpoint(f"cell {cell}'s new learner found no holder of the "
                                       f"state", cell=cell)
            try:
                loaded, _ = s.ray.get([learner.set_xlong_state.remote(s.learners.state_ref),
                                       learner.sleep.remote()])
                break
            except s.ray.Error as exc:
                # the new Learner alive, the state it was sent lost: its source went with a
                # node Ray has not marked dead yet (or a copy did); take it from elsewhere
                if not tries or not s.ray.lost(exc) or not s.ray.alive(learner):
                    raise
                s.learners.state_ref_lost()
        redo = s.learners.replace(cell, learner)
        # what it loaded, not what it was meant to: a state older than the group's (a holder
        # counted wrongly) makes the cell load the current one when it next joins
        s.learners.learner_version[cell] = int(loaded)
        return redo

    def _restore_role(self, cell: int, dropped: set[str], runner_new: bool,
                      learner_new: bool) -> None:
        """Put the cell's actors back into what its role expects."""
        s = self.state
        c, role = s.cells[cell], s.m.role[cell]
        if role is Role.DRAINING and runner_new:
            self.actions.rcall(cell, "drain")
        elif role is Role.TRAINING:
            after = self.actions.rcall(cell, "suspend") if runner_new else None
            in_step = s.m.step >= 0 and s.m.step_of[cell] == s.m.step
            if dropped & {"switch", "load"} or learner_new:
                s.in_flight.pop(cell, None)
                s.awake.discard(cell)
                if in_step:
                    if cell in s.learners.members:
                        self.actions.requeue(s.learners.replace(cell, c.learner))
                    ref = s.learners.join(cell, after=after)
                else:
                    ref = c.learner.wake_up.remote(s.learners.state_ref, after)
                s.m.busy_until(cell, INF)
                s.pending[ref] = Pending("switch", cell, s.now())
        elif role is Role.SYNCING and ("sync" in dropped or runner_new):
            ref = self.actions.rcall(cell, "resume", s.learners.weights_ref, s.learners.version)
            s.pending[ref] = Pending("sync", cell, s.now(), version=s.learners.version)

    def _helper(self, cell: int) -> int:
        """A cell other than ``cell`` whose runner can process spooled runs."""
        for other in range(len(self.state.cells)):
            if other != cell and other not in self.retired:
                return other
        raise CellActorDied(f"cell {cell}: node lost and no other cell is left")

    def retire(self, cell: int, why: str, t0: float) -> None:
        """``cell``'s node is gone: deliver what it spooled, restart its live runs elsewhere,
        rebuild the payloads of its ended untrained runs, requeue its micro-batches."""
        s = self.state
        now = s.now()
        s.m.cell_lost(cell, "node", now)
        helper = self._helper(cell)
        spooled = self.from_spool(cell, s.cells[helper].runner, payload_cell=helper)
        s.pool.stop_actors(cell)  # a survivor on another node must not run on
        s.learners.node_lost(cell)  # the state / weights copies its Learner made are gone
        s.chain.pop(cell, None)
        try:
            orphans = s.m.retire_cell(cell, s.now())
        except Exception as exc:  # noqa: BLE001 - the last cell: nothing to continue on
            raise CellActorDied(f"cell {cell}: node lost ({why}) and it cannot retire: "
                                f"{exc}") from exc
        self.drop_pending(cell, RUNNER_KINDS + LEARNER_KINDS)
        self._rebuild_payloads(cell, helper)
        redo = self.actions.requeue(s.learners.replace(cell, s.cells[cell].learner))
        s.in_flight.pop(cell, None)
        s.awake.discard(cell)
        self.retired.add(cell)
        self._record("node", cell, now, t0, why=why, rerun=len(orphans),
                     from_spool=spooled, redone=len(redo), retired=True)

    def _rebuild_payloads(self, cell: int, helper: int) -> None:
        """Runs that ended on ``cell`` and are not trained lost their payload with its node:
        the ``helper`` cell's runner processes them again from the spool."""
        s = self.state
        lost = sorted(r for r, e in s.held_runs.items() if e.cell == cell)
        if not lost:
            return
        if s.spool is None:
            raise CellActorDied(f"cell {cell}: node lost with runs {lost} ended on it and not "
                                f"trained yet; without a spool (spool_dir) they are gone")
        digests_ref, payload = s.cells[helper].runner.process_spooled.remote(lost)
        fresh = {d.run_id: EndedRun(d, payload, helper) for d in s.ray.get(digests_ref)}
        s.held_runs.update(fresh)
        for group, runs in s.ended.items():
            s.ended[group] = [fresh.get(e.digest.run_id, e) for e in runs]

    def check_retired(self) -> None:
        """Rebuild retired cells whose placement group Ray has placed again."""
        s = self.state
        for cell in sorted(self.retired):
            if not s.pool.placed(cell):
                continue
            t0, start = time.perf_counter(), s.now()
            try:
                self.new_learner(cell, timeout_s=30.0)
                runner = s.pool.replace(cell, "runner", timeout_s=30.0)
                s.chain.pop(cell, None)
            except TimeoutError:
                continue
            except s.ray.Error as exc:     # the state's holder died meanwhile (a node removed
                if not s.ray.lost(exc):    # before Ray marked it dead): try on a later tick,
                    raise                  # a bounded number of times
                self.lost_rebuilds[cell] = self.lost_rebuilds.get(cell, 0) + 1
                if self.lost_rebuilds[cell] >= REBUILD_TRIES:
                    raise CellActorDied(f"cell {cell}: its node returned, but loading the state "
                                        f"into its new Learner failed {REBUILD_TRIES} times: "
                                        f"{exc}") from exc
                continue
            s.ray.get(runner.resume.remote(s.learners.weights_ref, s.learners.version))
            self.retired.discard(cell)
            self.lost_rebuilds.pop(cell, None)
            s.m.rebuild_cell(cell, s.now())
            self.actions.watch_runs(cell)
            self._record("node_returned", cell, start, t0)

    # -- every holder of the state lost ------------------------------------------------------
    def holders(self) -> list[int]:
        """Cells whose live Learner holds the current state (applied the last step, or loaded
        it since)."""
        s = self.state
        g = s.learners
        return [c for c in g.holders() if c not in s.retired and s.ray.alive(g.learners[c])]

    def state_lost(self) -> bool:
        """No copy of the current state is left: no holder is alive and the group keeps no
        object-store copy of that version."""
        g = self.state.learners
        return g is not None and not self.holders() \
            and (g.kept is None or g.kept[0] != g.version)

    def state_source(self, version: int) -> Any:
        """The learner group's ``state_source``: no live learner holds ``version``, so a live
        one reloads the last checkpoint and replays the steps since (:meth:`reload_checkpoint`);
        returns a ref of the state from that learner (never through the driver)."""
        self.reload_checkpoint("no live learner holds the state", target=version)
        g = self.state.learners
        return g.learners[g.lead].get_xlong_state.remote()

    def reload_checkpoint(self, why: str, *, cell: int | None = None,
                          target: int | None = None) -> int:
        """Rebuild the current state (module docstring, "state lost"): ``cell``'s Learner (or
        the first live cell's) loads the last completed checkpoint and replays every step since
        up to version ``target`` (default: the group's) from the spool; it becomes the state's
        holder. Returns the steps replayed.

        Raises:
            CellActorDied: no checkpoint, no spool, or a replayed step's runs are gone.
        """
        s = self.state
        t0, now = time.perf_counter(), s.now()
        g = s.learners
        target = g.version if target is None else target
        if s.checkpoint_ref is not None:   # a save in flight: let it finish (or fail) first
            s.ray.wait([s.checkpoint_ref], num_returns=1, timeout=0)
        done = latest(s.cfg.checkpoint_dir)
        if done is None or s.spool is None:
            raise CellActorDied(f"{why}: every holder of the state (version {target}) is lost "
                                f"and there is no checkpoint to reload (checkpoint_dir "
                                f"{s.cfg.checkpoint_dir!r}, spool_dir {s.cfg.spool_dir!r})")
        version, path = done
        if cell is None:
            cell = next((c for c in range(len(s.cells)) if c not in s.retired
                         and c not in g.members and s.ray.alive(s.cells[c].learner)), None)
            if cell is None:
                raise CellActorDied(f"{why}: the state is lost and no live Learner can reload "
                                    f"it")
        learner, runner = s.cells[cell].learner, self._spool_reader(cell)
        s.ray.get(learner.load_checkpoint.remote(str(path)))
        s.ray.get(learner.wake_up.remote(None))
        replayed = runs = 0
        for v in range(version, target):
            ids = list(s.trained.get(v - s.version_offset, []))
            missing = sorted(set(ids) - s.spool.run_ids())
            if not ids or missing:
                raise CellActorDied(f"{why}: replaying step {v} from the spool: runs "
                                    f"{missing[:5] or '(none recorded)'} are not there")
            digests_ref, payload = runner.process_spooled.remote(ids)
            by_id = {d.run_id: d for d in s.ray.get(digests_ref)}
            micro, _ = plan_step([by_id[r] for r in ids], processor=s.cfg.processor,
                                 max_tokens=s.cfg.learner.micro_batch_tokens)
            s.ray.get([learner.accumulate_runs.remote(mb.run_ids, mb.advantages, v, payload)
                       for mb in micro])
            grads = learner.take_gradients.remote()
            s.ray.get(learner.apply_step.remote([grads], sum(mb.weight for mb in micro), v + 1))
            replayed, runs = replayed + 1, runs + len(ids)
        if cell not in s.awake:
            s.ray.get(learner.sleep.remote())
        g.reloaded(cell, learner, target)
        self._record("state", cell, now, t0, why=f"{why}: reloaded version {version}, replayed "
                     f"{replayed} steps", from_spool=runs)
        return replayed

    def _spool_reader(self, cell: int) -> Any:
        """A live runner to process spooled runs (``cell``'s, else another cell's)."""
        s = self.state
        for c in [cell] + [c for c in range(len(s.cells)) if c != cell]:
            if c not in s.retired and s.ray.alive(s.cells[c].runner):
                return s.cells[c].runner
        raise CellActorDied("no live runner to read the spool")
