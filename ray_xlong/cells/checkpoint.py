"""Driver checkpoints of a job on cells: a new driver continues where a lost one stopped.

```
save(actuator)      at step boundaries (CellJobConfig.checkpoint_every): learner state (weights,
                    Adam, version), the cell machine (ledger, event log), the policy, the digests
                    of ended-but-untrained runs (their tokens stay in the spool), trained-run
                    ids, stats and fault records → <checkpoint_dir>/driver_checkpoint.pt
                    (written, then renamed); spool entries of trained runs are dropped
resume(actuator, p) in a new driver on fresh cells: every cell on the saved state; the ended,
                    untrained runs processed again from the spool; runs live at the checkpoint
                    that ended since come from the spool, the others start again
```

A checkpoint needs the spool (``CellJobConfig`` refuses ``checkpoint_dir`` without
``spool_dir``): it holds the tokens of every run the checkpoint still owes.
"""

from __future__ import annotations

import collections
import os
import pathlib
import time
from typing import TYPE_CHECKING

import ray
import torch

from ray_xlong.cells.records import EndedRun
from ray_xlong.cells.learner_group import ElasticLearnerGroup
from ray_xlong.scheduling import Role

if TYPE_CHECKING:
    from ray_xlong.cells.actuator import RayActuator

CHECKPOINT = "driver_checkpoint.pt"
"""File name of the driver checkpoint inside ``CellJobConfig.checkpoint_dir``."""
FORMAT = 2
"""2: ended runs as digests (tokens in the spool); 1 wrote them into the checkpoint."""


def save(act: RayActuator) -> pathlib.Path:
    """Write the driver checkpoint atomically; returns its path."""
    root = pathlib.Path(act.cfg.checkpoint_dir)
    root.mkdir(parents=True, exist_ok=True)
    state = {
        "format": FORMAT, "mode": act.policy.name, "job": act.cfg.job,
        "time": act.now(), "machine": act.m, "policy": act.policy,
        "ended": {g: [e.digest for e in runs] for g, runs in act.ended.items() if runs},
        "trained": act.trained, "learner": ray.get(act.learners.state_ref),
        "token_staleness": act.token_staleness,
        "stats": dict(act.stats), "faults": act.recovery.records,
    }
    path, tmp = root / CHECKPOINT, root / f".{CHECKPOINT}.tmp"
    torch.save(state, tmp)
    os.replace(tmp, path)
    if act.spool is not None:
        act.spool.discard(act.spooled_trained)
    act.spooled_trained.clear()
    return path


def resume(act: RayActuator, path: str | os.PathLike) -> None:
    """Load a driver checkpoint into ``act`` (a new driver) and its fresh cells."""
    state = torch.load(path, weights_only=False)
    if state.get("format") != FORMAT or state["job"] != act.cfg.job:
        raise ValueError(f"RayActuator.resume_from: {path} is not a checkpoint of this job "
                         f"({state.get('job')} vs {act.cfg.job})")
    act.m, act.policy = state["machine"], state["policy"]
    act.trained = state["trained"]
    act.token_staleness = state["token_staleness"]
    act.stats = collections.defaultdict(list, state["stats"])
    act.recovery.records = list(state["faults"])
    learner_state = state["learner"]
    ray.get([call for cell in act.cells for call in (
        cell.learner.set_xlong_state.remote(learner_state), cell.learner.sleep.remote())])
    act.learners = ElasticLearnerGroup([c.learner for c in act.cells], state=learner_state,
                                       durable=True)
    ray.get([c.runner.resume.remote(act.learners.weights_ref, act.learners.version)
             for c in act.cells])
    _ended_from_spool(act, state["ended"])
    act.t0 = time.monotonic() - float(state["time"])
    act.m.resume(act.now())  # the runs it still owes stay live on their cells
    from_spool = rerun = 0
    for cell in range(len(act.cells)):
        spooled, again = act.recovery.take_over_runs(cell)
        from_spool, rerun = from_spool + spooled, rerun + again
        if act.m.role[cell] is Role.DRAINING:
            act.rcall(cell, "drain")
    if act.spool is not None:  # results of runs started after the checkpoint: re-run
        act.spool.discard(act.spool.run_ids() - set(act.held_runs))
    act.resumed_at = time.time()
    act.recovery.records.append({"kind": "driver", "cell": -1, "t": act.now(),
                                 "runs_rerun": rerun, "runs_from_spool": from_spool,
                                 "micro_batches_redone": 0, "recover_s": 0.0})


def _ended_from_spool(act: RayActuator, ended: dict) -> None:
    """The checkpoint's ended, untrained runs: processed again from the spool (by cell 0's
    runner) into payloads; held as they were."""
    ids = [d.run_id for digests in ended.values() for d in digests]
    act.ended = collections.defaultdict(list)
    if not ids:
        return
    if act.spool is None:
        raise ValueError("RayActuator.resume_from: the checkpoint owes runs "
                         f"{sorted(ids)[:5]}… but the job has no spool to read them from")
    digests_ref, payload = act.cells[0].runner.process_spooled.remote(ids)
    fresh = {d.run_id: d for d in ray.get(digests_ref)}
    for group, digests in ended.items():
        act.ended[group] = [EndedRun(fresh[d.run_id], payload, 0) for d in digests]
    act.held_runs.update({e.digest.run_id: e for runs in act.ended.values() for e in runs})
