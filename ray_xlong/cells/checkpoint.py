"""Driver checkpoints of a job on cells: a new driver continues where a lost one stopped.

```
save(state)         at step boundaries (CellJobConfig.checkpoint_every): learner state (weights,
                    Adam, version), the cell machine (ledger, event log), the policy, the digests
                    of ended-but-untrained runs (their tokens stay in the spool), trained-run
                    ids, stats and fault records → <checkpoint_dir>/driver_checkpoint.pt
                    (written, then renamed); spool entries of trained runs are dropped
resume(state, p, …) in a new driver on fresh cells: every cell on the saved state; the ended,
                    untrained runs processed again from the spool; runs live at the checkpoint
                    that ended since come from the spool, the others start again
```

Both take the job's state (``job_state.JobState``), not the actuator; ``resume`` also the
recovery (it takes over the runs each fresh cell owes) and the actuator's actions; Ray is
reached only through ``JobState.ray``.

A checkpoint needs the spool (``CellJobConfig`` refuses ``checkpoint_dir`` without
``spool_dir``): it holds the tokens of every run the checkpoint still owes.
"""

from __future__ import annotations

import collections
import os
import pathlib
import time

import torch

from ray_xlong.cells.job_state import JobState
from ray_xlong.cells.learner_group import ElasticLearnerGroup
from ray_xlong.cells.protocols import JobActions
from ray_xlong.cells.records import EndedRun, FaultRecord
from ray_xlong.cells.recovery import Recovery
from ray_xlong.scheduling import Role

CHECKPOINT = "driver_checkpoint.pt"
"""File name of the driver checkpoint inside ``CellJobConfig.checkpoint_dir``."""
FORMAT = 2
"""2: ended runs as digests (tokens in the spool); 1 wrote them into the checkpoint."""


def save(job: JobState) -> pathlib.Path:
    """Write the driver checkpoint atomically; returns its path."""
    root = pathlib.Path(job.cfg.checkpoint_dir)
    root.mkdir(parents=True, exist_ok=True)
    state = {
        "format": FORMAT, "mode": job.policy.name, "job": job.cfg.job,
        "time": job.now(), "machine": job.m, "policy": job.policy,
        "ended": {g: [e.digest for e in runs] for g, runs in job.ended.items() if runs},
        "trained": job.trained, "learner": job.ray.get(job.learners.state_ref),
        "token_staleness": job.token_staleness,
        "stats": dict(job.stats), "faults": job.faults,
    }
    path, tmp = root / CHECKPOINT, root / f".{CHECKPOINT}.tmp"
    torch.save(state, tmp)
    os.replace(tmp, path)
    if job.spool is not None:
        job.spool.discard(job.spooled_trained)
    job.spooled_trained.clear()
    return path


def resume(job: JobState, path: str | os.PathLike, *, recovery: Recovery,
           actions: JobActions) -> None:
    """Load a driver checkpoint into ``job`` (a new driver's state) and its fresh cells.

    Args:
        job: the new driver's job state (its cells fresh, nothing started).
        path: the checkpoint (:data:`CHECKPOINT`).
        recovery: takes over the runs each cell still owes (``Recovery.take_over_runs``).
        actions: the actuator's actions (``rcall``: drain the cells that were draining).
    """
    state = torch.load(path, weights_only=False)
    if state.get("format") != FORMAT or state["job"] != job.cfg.job:
        raise ValueError(f"RayActuator.resume_from: {path} is not a checkpoint of this job "
                         f"({state.get('job')} vs {job.cfg.job})")
    job.m, job.policy = state["machine"], state["policy"]
    job.trained = state["trained"]
    job.token_staleness = state["token_staleness"]
    job.stats = collections.defaultdict(list, state["stats"])
    job.faults[:] = list(state["faults"])
    learner_state = state["learner"]
    job.ray.get([call for cell in job.cells for call in (
        cell.learner.set_xlong_state.remote(learner_state), cell.learner.sleep.remote())])
    job.learners = ElasticLearnerGroup([c.learner for c in job.cells], state=learner_state,
                                       ray=job.ray)
    job.ray.get([c.runner.resume.remote(job.learners.weights_ref, job.learners.version)
                 for c in job.cells])
    _ended_from_spool(job, state["ended"])
    job.t0 = time.monotonic() - float(state["time"])
    job.m.resume(job.now())  # the runs it still owes stay live on their cells
    from_spool = rerun = 0
    for cell in range(len(job.cells)):
        spooled, again = recovery.take_over_runs(cell)
        from_spool, rerun = from_spool + spooled, rerun + again
        if job.m.role[cell] is Role.DRAINING:
            actions.rcall(cell, "drain")
    if job.spool is not None:  # results of runs started after the checkpoint: re-run
        job.spool.discard(job.spool.run_ids() - set(job.held_runs))
    job.resumed_at = time.time()
    job.faults.append(FaultRecord("driver", -1, "resumed from a checkpoint", job.now(), 0.0,
                                  runs_rerun=rerun, runs_from_spool=from_spool))


def _ended_from_spool(job: JobState, ended: dict) -> None:
    """The checkpoint's ended, untrained runs: processed again from the spool (by cell 0's
    runner) into payloads; held as they were."""
    ids = [d.run_id for digests in ended.values() for d in digests]
    job.ended = collections.defaultdict(list)
    if not ids:
        return
    if job.spool is None:
        raise ValueError("RayActuator.resume_from: the checkpoint owes runs "
                         f"{sorted(ids)[:5]}… but the job has no spool to read them from")
    digests_ref, payload = job.cells[0].runner.process_spooled.remote(ids)
    fresh = {d.run_id: d for d in job.ray.get(digests_ref)}
    for group, digests in ended.items():
        job.ended[group] = [EndedRun(fresh[d.run_id], payload, 0) for d in digests]
    job.held_runs.update({e.digest.run_id: e for runs in job.ended.values() for e in runs})
