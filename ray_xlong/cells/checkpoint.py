"""Checkpoints of a job on cells: the Learner state as sharded DCP checkpoints that the Learners
write themselves, the driver's records beside them — a new driver, or a job that lost every
holder of its state, continues from there.

```
<checkpoint_dir>/
  learner-v000004/          DCP of the lead Learner at version 4 (every rank its shards;
                            ``shard_checkpoint.py``), written in the background
  driver_checkpoint.pt      the driver's records of that version (written by the Learner's
                            rank 0 once every shard is on disk, then renamed)
  latest.json               {"version": 4, "learner_dir": "learner-v000004"}, renamed last

save(job)           at step boundaries (CellJobConfig.checkpoint_every) and at the last step:
                    the lead Learner (a member that applied the step) starts its async save and
                    gets the records (small: the cell machine, policy, digests of ended untrained
                    runs, trained-run ids, stats, fault records; no tensors) to write once done;
                    the driver does not wait. A checkpoint that completed since the last save
                    lets the spool drop the runs it covers; older Learner dirs go
resume(job, p, …)   a new driver on fresh cells: every Learner loads the checkpoint from the
                    shared path; the ended, untrained runs processed again from the spool; runs
                    live at the checkpoint that ended since come from the spool, the others
                    start again; a cell lost meanwhile (its node removed) goes to the recovery
                    (rebuilt, or retired until its node is back)
latest(root)        (version, learner dir) of the last completed checkpoint (None: none yet)
```

``save`` / ``resume`` take the job's state (``job_state.JobState``), not the actuator;
``resume`` also the recovery (it takes over the runs each fresh cell owes) and the actuator's
actions; Ray is reached only through ``JobState.ray``. A failed save (a full disk, a Learner
lost while writing) is logged; the next save tries again and, meanwhile, the spool keeps every
run trained since the last completed one (``recovery.Recovery.reload_checkpoint`` replays them).

A checkpoint needs the spool (``CellJobConfig`` refuses ``checkpoint_dir`` without
``spool_dir``): it holds the tokens of every run the checkpoint still owes.
"""

from __future__ import annotations

import collections
import io
import json
import logging
import os
import pathlib
import shutil
import time

import torch

from ray_xlong.cells.job_state import JobState
from ray_xlong.cells.learner_group import ElasticLearnerGroup
from ray_xlong.cells.protocols import JobActions
from ray_xlong.cells.records import CellActorDied, EndedRun, FaultRecord
from ray_xlong.cells.recovery import Recovery
from ray_xlong.cells.shard_checkpoint import LATEST, latest  # noqa: F401 (re-exported)
from ray_xlong.scheduling import Role

log = logging.getLogger(__name__)
CHECKPOINT = "driver_checkpoint.pt"
"""File name of the driver's records inside ``CellJobConfig.checkpoint_dir``."""
FORMAT = 3
"""3: the Learner state as a DCP checkpoint the Learners write (``learner_dir``); 2 held the
whole state in the driver's file."""
MIN_FREE_BYTES = 64 * 1024 ** 2
"""A ``checkpoint_dir`` with less free space is refused before the first step."""


def learner_dir_name(version: int) -> str:
    return f"learner-v{version:06d}"


def check_dir(path: str | os.PathLike) -> pathlib.Path:
    """``path`` exists (made), is writable and has room; raises naming it otherwise (called
    before the first step)."""
    root = pathlib.Path(path)
    try:
        root.mkdir(parents=True, exist_ok=True)
        probe = root / f".probe.{os.getpid()}"
        probe.write_bytes(b"x")
        probe.unlink()
    except OSError as exc:
        raise ValueError(f"CellJobConfig.checkpoint_dir {str(root)!r} is not writable: "
                         f"{exc}") from exc
    free = shutil.disk_usage(root).free
    if free < MIN_FREE_BYTES:
        raise ValueError(f"CellJobConfig.checkpoint_dir {str(root)!r} is full ({free} bytes "
                         f"free, {MIN_FREE_BYTES} needed at least)")
    return root


def records(job: JobState) -> dict:
    """The driver's records of the current version (no tensors)."""
    version = job.learners.version
    return {
        "format": FORMAT, "mode": job.policy.name, "job": job.cfg.job,
        "time": job.now(), "machine": job.m, "policy": job.policy,
        "ended": {g: [e.digest for e in runs] for g, runs in job.ended.items() if runs},
        "trained": job.trained, "version": version, "version_offset": job.version_offset,
        "learner_dir": learner_dir_name(version),
        "token_staleness": job.token_staleness,
        "stats": dict(job.stats), "faults": job.faults,
    }


def _lead(job: JobState) -> int | None:
    """A cell whose Learner holds the current state (the last step's lead first; None: no
    holder is left)."""
    g = job.learners
    holders = [c for c in g.holders() if c not in job.retired]
    if g.lead in holders:
        return g.lead
    return holders[0] if holders else None


def save(job: JobState, *, final: bool = False) -> pathlib.Path | None:
    """Start a checkpoint of the current version (module docstring); ``final``: wait until it
    is on disk (the job's end). Returns the Learner checkpoint dir it goes to (None: no Learner
    holds the state right now; logged, the next save tries again)."""
    root = pathlib.Path(job.cfg.checkpoint_dir)
    lead = _lead(job)
    if lead is None:
        log.error("checkpoint.save: no Learner holds version %d now; the next save tries again",
                  job.learners.version)
        return None
    rec = records(job)
    buf = io.BytesIO()
    torch.save(rec, buf)
    version = rec["version"]
    files = {CHECKPOINT: buf.getvalue(),
             LATEST: json.dumps({"version": version, "learner_dir": rec["learner_dir"]}).encode()}
    path = root / rec["learner_dir"]
    learner = job.cells[lead].learner
    job.checkpoint_ref = learner.save_checkpoint.remote(str(path), files, False)
    if final:
        try:
            job.ray.get([job.checkpoint_ref, learner.wait_checkpoint.remote()])
        except job.ray.Error as exc:
            if not job.ray.lost(exc):
                raise
            log.error("checkpoint.save: the Learner writing %s was lost (%s)", path, exc)
    collect(job)
    return path


def collect(job: JobState) -> int | None:
    """A checkpoint completed since the last look: the spool drops the runs trained before it,
    older Learner dirs go. Returns its version (None: none yet)."""
    done = latest(job.cfg.checkpoint_dir)
    if done is None:
        return None
    version, keep = done
    covered = {r for step, ids in job.trained.items()
               if step + job.version_offset < version for r in ids}
    drop = job.spooled_trained & covered
    if job.spool is not None and drop:
        job.spool.discard(drop)
    job.spooled_trained -= drop
    for old in pathlib.Path(job.cfg.checkpoint_dir).glob("learner-v*"):
        if old.name < keep.name:
            shutil.rmtree(old, ignore_errors=True)
    return version


def resume(job: JobState, path: str | os.PathLike, *, recovery: Recovery,
           actions: JobActions) -> None:
    """Load a checkpoint into ``job`` (a new driver's state) and its fresh cells.

    Args:
        job: the new driver's job state (its cells fresh, nothing started).
        path: the driver's records (:data:`CHECKPOINT`); the Learner checkpoint beside it.
        recovery: takes over the runs each cell still owes (``Recovery.take_over_runs``).
        actions: the actuator's actions (``rcall``: drain the cells that were draining).

    A cell whose actors are lost while it loads (a node removed meanwhile) is recovered
    like a loss in the job (``Recovery.recover``): rebuilt in place, or retired until its
    node is back while its runs restart on the other cells.

    Raises:
        ValueError: a checkpoint of another job, or of another (newer) format (naming both).
        CellActorDied: every cell was lost while loading.
    """
    state = torch.load(path, weights_only=False)
    if state.get("format") != FORMAT:
        raise ValueError(f"RayActuator.resume_from: {path} is a checkpoint of format "
                         f"{state.get('format')}; this version reads format {FORMAT}")
    if state["job"] != job.cfg.job:
        raise ValueError(f"RayActuator.resume_from: {path} is not a checkpoint of this job "
                         f"({state.get('job')} vs {job.cfg.job})")
    job.m, job.policy = state["machine"], state["policy"]
    job.trained = state["trained"]
    job.token_staleness = state["token_staleness"]
    job.stats = collections.defaultdict(list, state["stats"])
    job.faults[:] = list(state["faults"])
    learner_dir = str(pathlib.Path(path).parent / state["learner_dir"])
    version = int(state["version"])
    lost = _load_learners(job, learner_dir, version)
    job.learners = ElasticLearnerGroup([c.learner for c in job.cells], version=version,
                                       state_source=recovery.state_source, ray=job.ray)
    for cell in lost:      # its Learner holds nothing
        job.learners.learner_version[cell] = -1
    job.learners.lead = min(set(range(len(job.cells))) - lost)
    no_runner = _resume_runners(job)
    _ended_from_spool(job, state["ended"], no_runner)
    job.t0 = time.monotonic() - float(state["time"])
    job.m.resume(job.now())  # the runs it still owes stay live on their cells
    from_spool = rerun = 0
    for cell in range(len(job.cells)):
        if cell in no_runner:
            continue
        try:
            spooled, again = recovery.take_over_runs(cell)
        except job.ray.Error as exc:    # its runner lost now: recovery takes its runs over
            if not job.ray.lost(exc):
                raise
            no_runner.add(cell)
            continue
        from_spool, rerun = from_spool + spooled, rerun + again
        if job.m.role[cell] is Role.DRAINING:
            actions.rcall(cell, "drain")
    job.faults.append(FaultRecord("driver", -1, "resumed from a checkpoint", job.now(), 0.0,
                                  runs_rerun=rerun, runs_from_spool=from_spool))
    for cell in sorted(lost | no_runner):   # rebuilt in place, or retired (node gone); its
        # runs that ended into the spool are delivered from there (before the discard)
        recovery.recover(cell, "lost while a new driver resumed from the checkpoint")
    if job.spool is not None:  # results of runs started after the checkpoint: re-run
        job.spool.discard(job.spool.run_ids() - set(job.held_runs))
    job.resumed_at = time.time()


def _load_learners(job: JobState, learner_dir: str, version: int) -> set[int]:
    """Every cell's Learner loads ``learner_dir`` (at ``version``) and sleeps. Returns the
    cells whose Learner was lost meanwhile (a node removed while the new driver loads).

    Raises:
        ValueError: a Learner loaded another version.
        CellActorDied: every cell was lost.
    """
    calls = {c: (cell.learner.load_checkpoint.remote(learner_dir), cell.learner.sleep.remote())
             for c, cell in enumerate(job.cells)}
    loaded, lost = {}, set()
    for cell, (load, sleep) in calls.items():
        try:
            loaded[cell] = int(job.ray.get(load))
            job.ray.get(sleep)
        except job.ray.Error as exc:
            if not job.ray.lost(exc):
                raise
            lost.add(cell)
    if not loaded:
        raise CellActorDied(f"RayActuator.resume_from: every cell was lost while its Learner "
                            f"loaded {learner_dir}")
    if set(loaded.values()) != {version}:
        raise ValueError(f"RayActuator.resume_from: {learner_dir} holds versions "
                         f"{sorted(set(loaded.values()))}, the records version {version}")
    return lost


def _resume_runners(job: JobState) -> set[int]:
    """Every runner loads the current weights and takes runs. Returns the cells whose runner
    was lost meanwhile. The weights object lost with its maker's node (the runners alive):
    made again from another holder, once."""
    todo, dead = list(range(len(job.cells))), set()
    for attempt in range(2):
        refs = {c: job.cells[c].runner.resume.remote(job.learners.weights_ref,
                                                     job.learners.version) for c in todo}
        todo = []
        for cell, ref in refs.items():
            try:
                job.ray.get(ref)
            except job.ray.Error as exc:
                if not job.ray.lost(exc):
                    raise
                if job.ray.alive(job.cells[cell].runner) and attempt == 0:
                    todo.append(cell)            # its weights were lost, not the runner
                else:
                    dead.add(cell)
        if not todo:
            return dead
        job.learners.forget_copies()
    return dead | set(todo)


def _ended_from_spool(job: JobState, ended: dict, lost: set[int]) -> None:
    """The checkpoint's ended, untrained runs: processed again from the spool (by the first
    runner not ``lost``; one lost meanwhile joins ``lost`` and the next one tries) into
    payloads; held as they were."""
    ids = [d.run_id for digests in ended.values() for d in digests]
    job.ended = collections.defaultdict(list)
    if not ids:
        return
    if job.spool is None:
        raise ValueError("RayActuator.resume_from: the checkpoint owes runs "
                         f"{sorted(ids)[:5]}… but the job has no spool to read them from")
    for cell in range(len(job.cells)):
        if cell in lost:
            continue
        digests_ref, payload = job.cells[cell].runner.process_spooled.remote(ids)
        try:
            fresh = {d.run_id: d for d in job.ray.get(digests_ref)}
        except job.ray.Error as exc:
            if not job.ray.lost(exc):
                raise
            lost.add(cell)
            continue
        break
    else:
        raise CellActorDied("RayActuator.resume_from: every runner was lost while the "
                            "checkpoint's ended runs were read from the spool")
    for group, digests in ended.items():
        job.ended[group] = [EndedRun(fresh[d.run_id], payload, cell) for d in digests]
    job.held_runs.update({e.digest.run_id: e for runs in job.ended.values() for e in runs})
