"""The actuator's weight syncs (``cells/actuator.py``) on in-process fakes, no Ray.

A runner has concurrency groups, so Ray does not run its calls in submission order: a call
whose arguments are ready runs before an earlier one still waiting for its own. A sync's
``resume(weights of v, v, slept)`` waits for its Learner's ``sleep`` (slow behind a checkpoint
save or a state transfer); when a step ends meanwhile, the step's push ``set_weights(v + 1)``
to that runner may run first, and the late ``resume`` then loads v over v + 1:

```
driver   Sync(c) at v ──resume(v, slept)──────────────┐  step v ends: push set_weights(v+1)
runner c                     set_weights(v+1) ◄────────┼──┘  runs first (its args are ready)
                             resume(v)  ◄──────────────┘     runs once slept resolved: engine v
machine  version v+1, cell c ready ─► runs stamped v+1 on an engine at v ─► token staleness 2
```

(the 20-minute chaos run's token staleness 2 > bound 1, with every group ≤ 1: cell 2 synced
at version 490 while step 490 ended on cell 0; its groups stamped 491 were trained at step 492).
"""

from __future__ import annotations

import pytest
import ray

from fakes import FakeActor, FakeJob, FakeRay, OnceWhen, fake_config
from ray_xlong.cells.job_state import INF
from ray_xlong.cells.metrics import check_invariants
from ray_xlong.scheduling import Role


@pytest.fixture(autouse=True)
def no_ray():
    yield
    assert not ray.is_initialized(), "a unit test of the cell runtime started Ray"


class SlowSyncRay(FakeRay):
    """``FakeRay`` whose ``wait`` leaves the refs in ``held`` unready (a call whose
    dependency has not resolved yet)."""

    def __init__(self) -> None:
        super().__init__()
        self.held: set = set()

    def wait(self, refs, *, num_returns, timeout):
        free = [r for r in refs if r not in self.held]
        ready, rest = super().wait(free, num_returns=min(num_returns, len(free)),
                                   timeout=timeout)
        return ready, rest + [r for r in refs if r in self.held]


class OvertakenRunner(FakeActor):
    """A runner handle on which the first sync ``resume`` sent while a step is in progress
    waits (its Learner's sleep is slow) until a later ``set_weights`` has run: Ray's order
    for an actor with concurrency groups (module docstring)."""

    def __init__(self, actor: FakeActor, ray: SlowSyncRay, act) -> None:
        super().__init__(actor.obj, actor.name)
        self.ray, self.act = ray, act
        self.late = None
        self.overtaken = 0

    def submit(self, method, args):
        ref = super().submit(method, args)
        if method == "resume" and not self.overtaken and self.late is None \
                and self.act.m.step >= 0:
            self.late = (self.queue.pop(), ref)    # out of the queue until the push ran
            self.ray.held.add(ref)
        elif method == "set_weights" and self.late is not None:
            call, held = self.late
            self.queue.append(call)                # runs after the push
            self.ray.held.discard(held)
            self.late, self.overtaken = None, self.overtaken + 1
        return ref


def _engines_behind(act) -> list[tuple[int, int, int]]:
    """(cell, its engine's version, the current version) of every ready cell in rollout
    whose engine is not on the current weights (pushes wait until applied: there is none)."""
    s = act.state
    return [(c, act.pool.runner(c).version, s.learners.version)
            for c, role in enumerate(s.m.role)
            if role is Role.ROLLOUT and s.m.ready_at[c] != INF and c not in s.retired
            and act.pool.runner(c).version != s.learners.version]


def test_a_step_push_that_overtakes_a_syncs_resume_leaves_no_engine_behind(tmp_path):
    cfg = fake_config(tmp_path, steps=8)
    job = FakeJob.make(cfg)
    job.ray = SlowSyncRay()
    job.pool.ray = job.ray
    act = job.actuator()
    runners = []
    for cell in job.pool.cells:
        cell.runner = OvertakenRunner(cell.runner, job.ray, act)
        runners.append(cell.runner)
    behind: list = []
    act.injector = OnceWhen(lambda a: behind.extend(_engines_behind(a)))
    result = act.run()
    assert sum(r.overtaken for r in runners) >= 1, "no step ended during a sync"
    assert behind == []
    assert check_invariants(result, staleness_bound=cfg.job.staleness_bound) == []
    trained = [r for step in result.trained_runs for r in step]
    assert job.ledger.trained() == {r: 1 for r in trained}
