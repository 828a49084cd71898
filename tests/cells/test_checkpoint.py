"""Driver checkpoints (``cells/checkpoint.py``) on in-process fakes, no Ray: a driver saves at a
step boundary and dies; a new driver on fresh cells resumes from the file into a fresh job
state — the trained run ids are kept, the ended untrained runs and the runs that ended into the
spool since are processed again from the spool, the others start again, and every run of the
job is trained exactly once over both drivers. A checkpoint of another job is refused.
"""

from __future__ import annotations

import dataclasses

import pytest
import ray
import torch

from fakes import FakeJob, OnceWhen, fake_config
from ray_xlong.cells import checkpoint
from ray_xlong.cells.metrics import check_invariants
from ray_xlong.cells.runs import run_key


@pytest.fixture(autouse=True)
def no_ray():
    yield
    assert not ray.is_initialized(), "a unit test of the cell runtime started Ray"


def first_driver(cfg):
    """A driver that runs until its first checkpoint (step 1 applied), ends one run that was
    live at the checkpoint into the spool without reporting it, then dies with its cells.
    Returns (its job, the checkpoint's contents, that run's id). Runs take 4 polls: at the
    checkpoint a group has ended untrained and runs of the next are live."""
    job = FakeJob.make(cfg, polls=4)
    act = job.actuator()
    act.start(job.pool.initial_state, job.pool.initial_weights)
    act.act()
    while act.m.version < 1:
        act.tick()
    act.state.ray.get(act.state.checkpoint_ref)   # the Learner wrote it (fakes: lazily)
    trained = set(act.trained[0])
    assert trained <= job.pool.runner(0).spool.run_ids()  # kept until known on disk
    assert checkpoint.collect(act.state) == 1             # the driver sees it completed
    saved = torch.load(pathlib_of(cfg), weights_only=False)
    owed = {run_key(r) for live in saved["machine"].live for r in live}
    run_id = next(r for c in range(len(act.cells)) for r in sorted(job.pool.runner(c).live)
                  if r in owed)
    cell = next(c for c in range(len(act.cells)) if run_id in job.pool.runner(c).live)
    job.pool.runner(cell).end_now(run_id)
    job.pool.kill_all()
    return job, saved, run_id


def pathlib_of(cfg):
    import pathlib

    return pathlib.Path(cfg.checkpoint_dir) / checkpoint.CHECKPOINT


def test_save_then_resume_into_a_fresh_job_state(tmp_path):
    cfg = fake_config(tmp_path, checkpoint=True, steps=3)
    first, saved, spooled_run = first_driver(cfg)
    assert saved["version"] == 1 and list(saved["trained"]) == [0]
    assert "learner" not in saved and not any(torch.is_tensor(v) for v in saved.values())
    learner_dir = pathlib_of(cfg).parent / saved["learner_dir"]
    assert checkpoint.latest(cfg.checkpoint_dir) == (1, learner_dir)
    spool_ids = first.pool.runner(0).spool.run_ids()
    assert not spool_ids & set(saved["trained"][0])   # trained + checkpointed: dropped

    assert saved["ended"] and any(saved["machine"].live)
    second = FakeJob.make(cfg, ledger=first.ledger, polls=4)  # fresh cells, the same spool
    act = second.actuator()
    result = act.run(resume_from=pathlib_of(cfg))

    assert result.trained_runs[0] == tuple(saved["trained"][0])     # trained ids kept
    (driver,) = [f for f in result.faults if f.kind == "driver"]
    assert driver.runs_from_spool >= 1 and act.resumed_at is not None
    reads = [r for c in range(len(act.cells)) for r in second.pool.runner(c).spool_reads]
    owed_ended = {d.run_id for ds in saved["ended"].values() for d in ds}
    assert owed_ended <= set(second.pool.runner(0).spool_reads)     # payloads rebuilt
    assert spooled_run in reads                                      # ended since: spool
    assert check_invariants(result, staleness_bound=1) == []
    every = [r for step in result.trained_runs for r in step]
    assert sorted(every) == sorted(run_key(r) for r in range(cfg.job.total_runs))
    # step 1 was applied by the first driver, steps 2-3 by the second: each run once
    assert first.ledger.trained() == {r: 1 for r in every} and first.ledger.consistent()


def test_a_checkpoint_of_another_job_is_refused(tmp_path):
    cfg = fake_config(tmp_path, checkpoint=True, steps=3)
    first_driver(cfg)
    other = dataclasses.replace(cfg, job=dataclasses.replace(cfg.job, total_steps=4))
    act = FakeJob.make(other).actuator()
    with pytest.raises(ValueError, match="is not a checkpoint of this job"):
        act.run(resume_from=pathlib_of(cfg))


def test_a_checkpoint_of_another_format_is_refused_naming_both(tmp_path):
    cfg = fake_config(tmp_path, checkpoint=True, steps=3)
    first_driver(cfg)
    saved = torch.load(pathlib_of(cfg), weights_only=False)
    torch.save({**saved, "format": 2}, pathlib_of(cfg))
    act = FakeJob.make(cfg).actuator()
    with pytest.raises(ValueError, match="checkpoint of format 2; this version reads format 3"):
        act.run(resume_from=pathlib_of(cfg))


@pytest.mark.parametrize("cell", [pytest.param(0, id="cell-0-the-spool-reader"),
                                  pytest.param(2, id="cell-2")])
def test_a_node_lost_while_a_new_driver_loads_the_checkpoint_is_recovered(tmp_path, cell):
    cfg = fake_config(tmp_path, checkpoint=True, steps=4)
    first, saved, _ = first_driver(cfg)
    second = FakeJob.make(cfg, ledger=first.ledger, polls=4)
    second.pool.lose_node(cell)   # gone before its Learner's load_checkpoint answers
    act = second.actuator()
    act.injector = OnceWhen(lambda a: True if a.m.version > saved["version"] else None,
                            then=lambda a: second.pool.restore_node(cell))
    result = act.run(resume_from=pathlib_of(cfg))

    kinds = [(f.kind, f.cell) for f in result.faults]
    assert ("driver", -1) in kinds and ("node", cell) in kinds   # retired, its runs elsewhere
    assert ("node_returned", cell) in kinds                      # rebuilt once it came back
    _trained_once_over_both_drivers(cfg, first, result)


def test_a_learner_lost_while_a_new_driver_loads_the_checkpoint_is_rebuilt(tmp_path):
    cfg = fake_config(tmp_path, checkpoint=True, steps=4)
    first, saved, _ = first_driver(cfg)
    second = FakeJob.make(cfg, ledger=first.ledger, polls=4)
    second.pool.cells[1].learner.kill()   # its node stays: rebuilt in place
    result = second.actuator().run(resume_from=pathlib_of(cfg))

    kinds = [(f.kind, f.cell) for f in result.faults]
    assert ("driver", -1) in kinds and ("learner", 1) in kinds
    assert not any(f.retired for f in result.faults)
    _trained_once_over_both_drivers(cfg, first, result)


def _trained_once_over_both_drivers(cfg, first, result) -> None:
    assert check_invariants(result, staleness_bound=1) == []
    every = [r for step in result.trained_runs for r in step]
    assert sorted(every) == sorted(run_key(r) for r in range(cfg.job.total_runs))
    assert first.ledger.trained() == {r: 1 for r in every} and first.ledger.consistent()
