"""Fault injection and the exactly-once audit: what the fault suite and ``benchmarks/faults.py``
use to kill things on purpose and check that nothing finished was lost.

```
FaultInjector(plan, job, remove_node=…, restore_node=…)   actuator.injector = it
  tick(actuator)  once per driver loop: when the job's ended runs pass a seeded threshold,
                  kill a runner (one with live runs), a learner (a step member mid micro-batch
                  when there is one; of a multi-rank cell, one seeded rank: a rank lost inside
                  a sharded step) or a cell's node (cluster_utils.Cluster.remove_node), and
                  bring removed nodes back after ``node_down_s``
audit(result, job)  from the event log and the trained-run ids: runs lost, runs trained twice,
                    steps trained, policy versions consistent, invariant violations
```

Kills are real (``ray.kill(actor, no_restart=True)``, a raylet removed); only *when* and *whom*
is chosen here. ``python -m benchmarks.tools.faults`` is a driver process for the driver-restart
fault: it runs (or resumes) one job from a pickled :class:`~ray_xlong.cells.config.CellJobConfig`
on a running cluster and writes its result; the parent kills it and starts another. With
``--chaos`` it also fires the runner / learner faults of a chaos schedule that fall due
(:class:`ChaosInjector`, ``benchmarks/chaos.py``) and logs every delivered run's reward.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import pickle
import random
import time
from typing import Any, Callable

import ray

from ray_xlong.cells.metrics import RayResult, check_invariants
from ray_xlong.cells.sharded_cell import ShardedCell
from ray_xlong.cells.runs import run_key
from ray_xlong.scheduling import SchedulingConfig

KINDS = ("runner", "learner", "node", "driver")
"""Fault kinds (``driver`` is injected from outside the driver process)."""


@dataclasses.dataclass(frozen=True, slots=True)
class FaultPlan:
    """How many faults of each kind to inject into one job, and when (seeded)."""

    seed: int = 0
    """Chooses the moments and the victims."""
    runner: int = 0
    """Runner (engine) actors to kill."""
    learner: int = 0
    """Learner actors to kill."""
    node: int = 0
    """Cell nodes to remove (needs ``remove_node`` / ``restore_node``)."""
    node_down_s: float = 3.0
    """Seconds a removed node stays away before a node with its resources is added back."""
    window: tuple[float, float] = (0.1, 0.8)
    """Faults fire when this fraction of the job's runs has ended (uniform in the window)."""

    def __post_init__(self) -> None:
        for name in ("runner", "learner", "node"):
            if getattr(self, name) < 0:
                raise ValueError(f"FaultPlan.{name} must be >= 0, got {getattr(self, name)!r}")
        lo, hi = self.window
        if not 0.0 <= lo <= hi < 1.0:
            raise ValueError(f"FaultPlan.window must satisfy 0 <= lo <= hi < 1, got "
                             f"{self.window!r}")


@dataclasses.dataclass(frozen=True, slots=True)
class Injection:
    """One fault the injector fired."""

    kind: str
    """``runner`` | ``learner`` | ``node``."""
    cell: int
    """The victim cell."""
    rank: int | None
    """The Learner rank killed in a multi-rank cell (None: the whole actor)."""
    t: float
    """Job time it fired (seconds)."""
    runs_ended: int
    """Runs of the job that had ended by then."""


class FaultInjector:
    """Fires a :class:`FaultPlan` into a running :class:`~ray_xlong.cells.actuator.RayActuator`.
    """

    def __init__(self, plan: FaultPlan, job: SchedulingConfig, *,
                 remove_node: Callable[[str], Any] | None = None,
                 restore_node: Callable[[Any], None] | None = None) -> None:
        """Args:
            plan: what to inject.
            job: the job (its run count places the moments).
            remove_node: ``remove_node(node_id_hex) -> token`` removes that node (None: it
                cannot, the fault waits).
            restore_node: ``restore_node(token)`` adds a node like it back.
        """
        if plan.node and (remove_node is None or restore_node is None):
            raise ValueError("FaultInjector: plan.node needs remove_node and restore_node")
        self.plan, self.job = plan, job
        self.rng = random.Random(plan.seed)
        lo, hi = plan.window
        todo = [(self.rng.uniform(lo, hi) * job.total_runs, kind)
                for kind in ("runner", "learner", "node") for _ in range(getattr(plan, kind))]
        self.todo = collections.deque(sorted(todo))
        self.remove_node, self.restore_node = remove_node, restore_node
        self.down: list[tuple[float, Any]] = []  # (time to restore, token)
        self.injected: collections.Counter = collections.Counter()
        self.log: list[Injection] = []

    def tick(self, act: Any) -> None:
        """Fire every fault whose moment has come (a fault waits for a victim that would
        notice it: a runner with live runs, a learner training); restore nodes whose time is
        up."""
        now = time.monotonic()
        for due, token in list(self.down):
            if now >= due:
                self.restore_node(token)
                self.down.remove((due, token))
        ended = act.runs_ended()
        while self.todo and self.todo[0][0] <= ended:
            if not self._fire(self.todo[0][1], act):
                return  # no victim that would notice yet: try again next tick
            self.todo.popleft()

    def _fire(self, kind: str, act: Any) -> bool:
        """Kill one victim of ``kind``; False when there is none right now (a runner with live
        runs, a learner in the step in progress, a cell that is not the last)."""
        cells = [c for c in range(len(act.cells)) if c not in act.retired]
        rank = None
        if kind == "runner":
            busy = act.cells_with_live_runs()
            if not busy:
                return False
            cell = self.rng.choice(busy)
            ray.kill(act.cells[cell].runner, no_restart=True)
        elif kind == "learner":
            training = act.training_cells()  # those mid micro-batch first
            mid = [c for c in training if c in act.in_flight]
            if not mid and any(isinstance(act.cells[c].learner, ShardedCell) for c in training):
                return False  # a rank is lost inside a sharded step: wait for a micro-batch
            busy = mid or training
            if not busy:
                return False
            cell = self.rng.choice(busy)
            learner = act.cells[cell].learner
            if isinstance(learner, ShardedCell):
                rank = self.rng.randrange(len(learner))
                ray.kill(learner.ranks[rank], no_restart=True)
            else:
                ray.kill(learner, no_restart=True)
        else:
            if len(cells) < 2:
                return False  # never take the last cell
            placed = [c for c in cells if act.pool.placed(c)]
            if len(placed) < 2:
                return False
            cell = self.rng.choice(placed)
            from ray.util import placement_group_table

            nodes = set(placement_group_table(act.cells[cell].pg)["bundles_to_node_id"].values())
            tokens = [self.remove_node(node) for node in sorted(nodes)]
            if not any(t is not None for t in tokens):
                return False  # its node is not one we can remove (yet): try again later
            for token in tokens:
                if token is not None:
                    self.down.append((time.monotonic() + self.plan.node_down_s, token))
        self.injected[kind] += 1
        self.log.append(Injection(kind, cell, rank, act.now(), act.runs_ended()))
        return True

    def finish(self) -> None:
        """Bring back every node still down (call after the job)."""
        for _, token in self.down:
            self.restore_node(token)
        self.down.clear()


@dataclasses.dataclass(frozen=True, slots=True)
class Audit:
    """What the event log and trained-run ids say about a finished job."""

    steps: int
    """Steps trained (policy version reached)."""
    runs_trained: int
    """Distinct runs trained."""
    runs_lost: int
    """Runs of the job never trained (ended-and-dropped, or never finished)."""
    runs_trained_twice: int
    """Runs in more than one step's batch (or twice in one)."""
    runs_rerun: int
    """Runs started again after a fault (``run_restarted`` events)."""
    versions_consistent: bool
    """Steps ended in order, each raising the version by one, up to the target."""
    violations: tuple[str, ...]
    """``metrics.check_invariants`` findings."""

    @property
    def ok(self) -> bool:
        """Nothing lost, nothing twice, the target reached, versions and invariants hold."""
        return not (self.runs_lost or self.runs_trained_twice or self.violations) \
            and self.versions_consistent


def trained_checkpoint(checkpoint_dir: str) -> bool:
    """Whether ``checkpoint_dir`` holds a completed checkpoint of a trained version (the
    job's start, version 0, is checkpointed too: faults wait for training to have begun)."""
    from ray_xlong.cells.shard_checkpoint import latest

    done = latest(checkpoint_dir)
    return done is not None and done[0] >= 1


def audit(result: RayResult, job: SchedulingConfig) -> Audit:
    """Check ``result`` of ``job`` (see :class:`Audit`)."""
    trained = collections.Counter(r for step in result.trained_runs for r in step)
    want = {run_key(r) for r in range(job.total_runs)}
    ends = [e.version for e in result.events if e.kind == "step_ended"]
    return Audit(
        steps=len(ends), runs_trained=len(trained),
        runs_lost=len(want - set(trained)),
        runs_trained_twice=sum(1 for n in trained.values() if n > 1),
        runs_rerun=sum(1 for e in result.events if e.kind == "run_restarted"),
        versions_consistent=ends == list(range(1, job.total_steps + 1)),
        violations=tuple(check_invariants(result, staleness_bound=job.staleness_bound)))


# -- chaos: faults on a clock, across driver restarts ---------------------------------------------
@dataclasses.dataclass(frozen=True, slots=True)
class ChaosFault:
    """One fault of a chaos schedule (``benchmarks/chaos.py``)."""

    at: float
    """Unix time it is due."""
    kind: str
    """One of :data:`KINDS`."""
    index: int
    """Its position in the schedule (a restarted driver skips those fired already)."""


class ChaosInjector:
    """Fires the ``runner`` / ``learner`` faults of a chaos schedule that are due (the parent
    process fires ``node`` and ``driver``), each once across driver restarts: fired ones are
    appended to the settings' ``fired`` file. The settings (a pickled ``{"schedule", "seed",
    "fired", "rewards"}``) are read again whenever the file changes (the parent writes the
    schedule once the job's first checkpoint exists). Also an actuator observer: the reward of
    every delivered run goes to the ``rewards`` file as it arrives.

    Pacing: the settings' ``until`` (unix seconds, the fault window's end) holds the job back so
    that it cannot end before its faults: from the moment this driver reads the schedule, the
    steps left are spread evenly up to ``until`` (a step no earlier than its share of that
    time; due faults still fire while the loop is held). A machine slower than that pace is
    never held; after ``until`` the job runs free."""

    def __init__(self, settings_path: str, *, rewards_path: str) -> None:
        import os

        self.path, self.rewards_path = settings_path, rewards_path
        self.mtime = None
        self.todo: collections.deque = collections.deque()
        self.fired_path = None
        self.until: float | None = None
        self.pace_from: tuple[float, int] | None = None     # (time, version) at the schedule
        self.inner = FaultInjector(FaultPlan(seed=os.getpid()), SchedulingConfig(1, 1, 1, 0))

    def _load(self) -> None:
        import os

        try:
            mtime = os.path.getmtime(self.path)
        except OSError:
            return
        if mtime == self.mtime:
            return
        self.mtime = mtime
        with open(self.path, "rb") as f:
            c = pickle.load(f)
        self.fired_path = c["fired"]
        done = set()
        if os.path.exists(self.fired_path):
            with open(self.fired_path) as f:
                done = {int(line.split()[0]) for line in f if line.strip()}
        self.inner.rng = random.Random(c["seed"] * 1000 + len(done))
        self.todo = collections.deque(f for f in c["schedule"]
                                      if f.kind in ("runner", "learner") and f.index not in done)
        self.until, self.pace_from = c.get("until"), None

    def tick(self, act: Any) -> None:
        self._load()
        self._fire_due(act)
        if self.until is None or act.m.done:
            return
        if self.pace_from is None:
            self.pace_from = (time.time(), act.m.version)
        t0, v0 = self.pace_from
        left = max(1, act.cfg.job.total_steps - v0)
        due = t0 + (self.until - t0) * (act.m.version + 1 - v0) / left   # the next version's
        while time.time() < min(due, self.until):
            time.sleep(min(0.05, max(0.0, due - time.time())))
            self._fire_due(act)

    def _fire_due(self, act: Any) -> None:
        while self.todo and self.todo[0].at <= time.time():
            fault = self.todo[0]
            if not self.inner._fire(fault.kind, act):
                return                        # no victim that would notice yet
            self.todo.popleft()
            with open(self.fired_path, "a") as f:
                f.write(f"{fault.index} {fault.kind} {time.time():.3f}\n")

    # StepObserver
    def delivered(self, digest: Any) -> None:
        with open(self.rewards_path, "a") as f:
            f.write(f"{digest.run_id} {float(digest.reward)!r}\n")

    def taken(self, step: int, micro: Any, stats: Any) -> None:
        pass

    def staleness(self, step: int, stale: int) -> None:
        pass


# -- the driver process of the driver-restart fault ----------------------------------------------
def drive(config_path: str, address: str, out: str, *, resume: bool,
          chaos: str | None = None) -> None:
    """Connect to ``address``, create the cells of the pickled config, run (or resume from its
    checkpoint) the job, and pickle ``{"result", "resumed_at"}`` to ``out``. ``chaos``: a
    pickled ``{"schedule", "seed", "fired", "rewards"}`` (a :class:`ChaosInjector`)."""
    import os

    from ray_xlong.cells.actuator import RayActuator
    from ray_xlong.cells.checkpoint import CHECKPOINT
    from ray_xlong.cells.config import make_policy
    from ray_xlong.jobs.driver import start_cells

    with open(config_path, "rb") as f:
        config = pickle.load(f)
    ray.init(address=address, include_dashboard=False, log_to_driver=False)
    pool = start_cells(config)
    injector = None
    if chaos is not None:
        injector = ChaosInjector(chaos, rewards_path=chaos + ".rewards")
    act = RayActuator(config, make_policy(config), pool, observer=injector)
    act.injector = injector
    path = os.path.join(config.checkpoint_dir, CHECKPOINT)
    result = act.run(resume_from=path if resume else None)
    tmp = out + ".tmp"
    with open(tmp, "wb") as f:
        pickle.dump({"result": result, "resumed_at": act.resumed_at}, f)
    os.replace(tmp, out)
    pool.shutdown()
    ray.shutdown()


def main(argv: list[str] | None = None) -> None:  # pragma: no cover - run as a subprocess
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True, help="pickled CellJobConfig")
    p.add_argument("--address", required=True, help="Ray cluster address")
    p.add_argument("--out", required=True, help="where to pickle the result")
    p.add_argument("--resume", action="store_true", help="resume from the job's checkpoint")
    p.add_argument("--chaos", default=None, help="pickled chaos settings (benchmarks/chaos.py)")
    args = p.parse_args(argv)
    drive(args.config, args.address, args.out, resume=args.resume, chaos=args.chaos)


if __name__ == "__main__":  # pragma: no cover
    main()
