"""In-process fakes of the cell runtime's edges, so that the actuator, recovery and checkpoint
logic run in unit tests without Ray (``ray`` may be imported, it is never initialised).

```
FakeRay      ray_edge.RayCalls: get / wait resolve refs in process; put; lost / alive;
             reduce sums gradient parts (Counters of run ids)
FakeActor    a handle: ``actor.method.remote(*args)`` queues the call and returns a FakeRef;
             resolving a ref runs the actor's queue up to that call, in submission order (as
             Ray runs an actor's calls); top-level ref arguments are resolved first, and a
             failed one fails the call (a dependency error, as in Ray)
             kill(): queued and later calls fail (FakeActorDied); lose_node(): also every value
             it returned is gone (FakeObjectLost), as objects in a lost node's store are
FakeRunner   protocols.Runner: runs end after ``polls`` wait_ended calls, into a real RunSpool
             first (synthetic runs, digests from the real process_run); payload = run ids
FakeLearner  protocols.Learner: a gradient is a Counter of the run ids it trained; apply_step
             records the summed update per version in a Ledger (trained twice = a count of 2);
             save_checkpoint writes its state at once (torch.save) and the driver's records
FakePool     protocols.CellHost over those actors; lose_node / restore_node per cell
```
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from ray_xlong.cells.runs import RunSpec
from ray_xlong.cells.spool import RunSpool
from ray_xlong.rollout.run_records import RunInfo, RunResult
from ray_xlong.trajectory import ProcessorConfig
from ray_xlong.trajectory.per_run import RunDigest, process_run
from ray_xlong.trajectory.synthetic import SyntheticConfig, synthetic_run

RUN_SHAPE = SyntheticConfig(num_calls=4, vocab_size=64, context_budget=120, timeout_prob=0.0,
                            failed_prob=0.0, num_subagents=0, num_retries=0)
"""Small synthetic runs: a few calls, every run trainable."""


class FakeRayError(Exception):
    """Base of what a failed fake ref raises (``FakeRay.Error``)."""

    def __init__(self, message: str, cause: BaseException | None = None) -> None:
        super().__init__(message)
        self.cause = cause


class FakeActorDied(FakeRayError):
    """The actor of a call died (``ray.exceptions.RayActorError``)."""


class FakeObjectLost(FakeRayError):
    """A value lived in the object store of a lost node (``ray.exceptions.ObjectLostError``)."""


class FakeTaskError(FakeRayError):
    """The method raised (``ray.exceptions.RayTaskError``; ``cause`` is the error)."""


def returns(n: int) -> Callable[[Callable], Callable]:
    """Mark a fake actor method as having ``n`` returns (``@ray.method(num_returns=n)``)."""
    def mark(fn: Callable) -> Callable:
        fn.num_returns = n
        return fn
    return mark


class FakeRef:
    """One return of one call (or a put / reduce value), resolved on first use."""

    def __init__(self, resolve: Callable[[], tuple[Any, BaseException | None]],
                 actor: FakeActor | None = None) -> None:
        self._resolve, self.actor = resolve, actor
        self._outcome: tuple[Any, BaseException | None] | None = None

    @classmethod
    def ready(cls, value: Any) -> FakeRef:
        return cls(lambda: (value, None))

    def outcome(self) -> tuple[Any, BaseException | None]:
        """``(value, None)`` or ``(None, error)``."""
        if self._outcome is None:
            self._outcome = self._resolve()
        if self.actor is not None and self.actor.node_lost and self._outcome[1] is None:
            return None, FakeObjectLost(f"{self.actor.name}: value lost with its node")
        return self._outcome

    def get(self) -> Any:
        value, error = self.outcome()
        if error is not None:
            raise error
        return value


@dataclasses.dataclass
class _Call:
    method: str
    args: tuple[Any, ...]
    returns: int
    result: tuple[Any, BaseException | None] | None = None


class _Method:
    def __init__(self, actor: FakeActor, name: str) -> None:
        self.actor, self.name = actor, name

    def remote(self, *args: Any) -> Any:
        return self.actor.submit(self.name, args)


class FakeActor:
    """An in-process actor handle over ``obj`` (module docstring)."""

    def __init__(self, obj: Any, name: str) -> None:
        self.obj, self.name = obj, name
        self.dead = self.node_lost = False
        self.queue: collections.deque[_Call] = collections.deque()
        self.calls: collections.Counter[str] = collections.Counter()
        """Calls run, by method name."""

    def __getattr__(self, name: str) -> _Method:
        if name.startswith("__") and name != "__ray_ready__":
            raise AttributeError(name)
        return _Method(self, name)

    def submit(self, method: str, args: tuple[Any, ...]) -> Any:
        n = getattr(getattr(type(self.obj), method, None), "num_returns", 1)
        call = _Call(method, args, n)
        self.queue.append(call)

        def pick(i: int) -> Callable[[], tuple[Any, BaseException | None]]:
            def resolve() -> tuple[Any, BaseException | None]:
                self._run_through(call)
                value, error = call.result
                return (None, error) if error is not None else (
                    value[i] if n > 1 else value, None)
            return resolve
        refs = [FakeRef(pick(i), self) for i in range(n)]
        return refs if n > 1 else refs[0]

    def _run_through(self, call: _Call) -> None:
        while call.result is None:
            self._run(self.queue.popleft())

    def _run(self, call: _Call) -> None:
        if self.dead:
            call.result = (None, FakeActorDied(f"{self.name} died before {call.method}"))
            return
        args = []
        for a in call.args:
            if isinstance(a, FakeRef):
                value, error = a.outcome()
                if error is not None:
                    call.result = (None, FakeTaskError(f"{call.method}: a dependency failed",
                                                       error))
                    return
                a = value
            args.append(a)
        self.calls[call.method] += 1
        if call.method == "__ray_ready__":
            call.result = (True, None)
            return
        try:
            call.result = (getattr(self.obj, call.method)(*args), None)
        except Exception as exc:  # noqa: BLE001 - what Ray hands back as a task error
            call.result = (None, FakeTaskError(f"{self.name}.{call.method}: {exc!r}", exc))

    def kill(self) -> None:
        self.dead = True

    def lose_node(self) -> None:
        self.dead = self.node_lost = True


class FakeRay:
    """``ray_edge.RayCalls`` in process (module docstring)."""

    Error = FakeRayError

    def get(self, refs: Any, *, timeout: float | None = None) -> Any:
        if isinstance(refs, list):
            return [self.get(r) for r in refs]
        if not isinstance(refs, FakeRef):
            raise TypeError(f"FakeRay.get: not a ref: {refs!r}")
        return refs.get()

    def wait(self, refs: Sequence[Any], *, num_returns: int,
             timeout: float | None) -> tuple[list[Any], list[Any]]:
        refs = list(refs)
        for r in refs:   # every fake call finishes at once (failed ones count as ready)
            r.outcome()
        return refs[:num_returns], refs[num_returns:]

    def put(self, value: Any) -> FakeRef:
        return FakeRef.ready(value)

    def lost(self, exc: BaseException) -> bool:
        if isinstance(exc, (FakeActorDied, FakeObjectLost)):
            return True
        cause = getattr(exc, "cause", None)
        return isinstance(cause, BaseException) and cause is not exc and self.lost(cause)

    def alive(self, actor: Any) -> bool:
        return not actor.dead

    def peer_groups(self) -> None:
        return None                  # no process groups in process: the object store

    def kill(self, actor: Any) -> None:
        actor.kill()

    def reduce(self, parts: Sequence[Any], *, scheme: str) -> list[Any]:
        if scheme == "all" or len(parts) <= 1:
            return list(parts)

        def total() -> tuple[Any, BaseException | None]:
            out: collections.Counter[str] = collections.Counter()
            for p in parts:
                value, error = p.outcome() if isinstance(p, FakeRef) else (p, None)
                if error is not None:
                    return None, FakeTaskError("reduce: a part failed", error)
                out.update(value)
            return out, None
        return [FakeRef(total)]


class FakeRunner:
    """``protocols.Runner`` in process (module docstring): a run ends after ``polls`` of
    :meth:`wait_ended`, spooled first; :meth:`end_now` ends one into the spool unreported."""

    def __init__(self, *, cell: int, spool_dir: str, polls: int = 2,
                 processor: ProcessorConfig = ProcessorConfig()) -> None:
        self.cell, self.polls, self.processor = cell, polls, processor
        self.spool = RunSpool(spool_dir)
        self.live: dict[str, list[Any]] = {}      # run id -> [spec, polls left]
        self.ended: list[Any] = []
        self.draining = self.asleep = False
        self.version, self.weights = -1, None
        self.spool_reads: list[str] = []
        """Run ids read back by :meth:`process_spooled`."""

    def start_runs(self, specs: Sequence[RunSpec], *after: Any) -> list[str]:
        if self.draining or self.asleep:
            raise RuntimeError(f"cell {self.cell}: takes no new runs (draining or asleep)")
        for spec in specs:
            if spec.run_id in self.live:
                raise ValueError(f"RunSpec.run_id {spec.run_id!r} is already live")
            self.live[spec.run_id] = [spec, self.polls]
        return [s.run_id for s in specs]

    def drain(self, *after: Any) -> None:
        self.draining = True

    def suspend(self, *after: Any) -> float:
        self.draining = True
        if self.live:
            raise RuntimeError(f"cell {self.cell}: cannot sleep with {len(self.live)} live runs")
        self.asleep = True
        return 0.0

    def resume(self, weights: Mapping[str, Any] | None, version: int, *after: Any) -> float:
        if weights is not None:
            self.set_weights(weights, version)
        self.asleep = self.draining = False
        return 0.0

    def set_weights(self, state_dict: Mapping[str, Any], version: int) -> None:
        self.weights, self.version = dict(state_dict), version

    def receive_weights(self, spec: Any, version: int) -> float:
        raise RuntimeError("FakeRunner: broadcast weight sync needs process groups (Ray)")

    def num_live_runs(self) -> int:
        return len(self.live)

    def end_now(self, run_id: str) -> None:
        """End live run ``run_id`` into the spool without reporting it yet."""
        spec, _ = self.live.pop(run_id)
        run = synthetic_run(np.random.default_rng(spec.seed), run_id=spec.run_id,
                            group_id=spec.group_id, config=RUN_SHAPE,
                            policy_version=max(self.version, 0))
        self.spool.put(self.cell, RunResult(run, RunInfo("answer", 0, 0, 0, 0, 0, 0.0)))
        self.ended.append(run)

    @returns(2)
    def wait_ended(self, timeout_s: float) -> tuple[list[RunDigest], tuple[str, ...]]:
        for run_id, entry in list(self.live.items()):
            entry[1] -= 1
            if entry[1] <= 0:
                self.end_now(run_id)
        runs, self.ended = self.ended, []
        return self._processed(runs)

    @returns(2)
    def process_spooled(self, run_ids: list[str]) -> tuple[list[RunDigest], tuple[str, ...]]:
        got = self.spool.get(run_ids)
        missing = sorted(set(run_ids) - set(got))
        if missing:
            raise KeyError(f"cell {self.cell}: runs {missing} are not in the spool")
        self.spool_reads += list(run_ids)
        return self._processed([res.run for _, res in got.values()])

    def _processed(self, runs: list[Any]) -> tuple[list[RunDigest], tuple[str, ...]]:
        return ([process_run(r, self.processor).digest for r in runs],
                tuple(r.run_id for r in runs))


@dataclasses.dataclass
class Ledger:
    """What fake learners applied: per version, the summed update of every member."""

    applied: dict[int, list[collections.Counter[str]]] = dataclasses.field(
        default_factory=lambda: collections.defaultdict(list))

    def trained(self) -> collections.Counter[str]:
        """Times each run is in an applied update (one member's copy per version)."""
        out: collections.Counter[str] = collections.Counter()
        for updates in self.applied.values():
            out.update(updates[0])
        return out

    def consistent(self) -> bool:
        """Every member of every step applied the same update."""
        return all(all(u == ups[0] for u in ups) for ups in self.applied.values())


class FakeLearner:
    """``protocols.Learner`` in process (module docstring)."""

    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger
        self.version, self.asleep = 0, False
        self.grad: collections.Counter[str] = collections.Counter()
        self.weights = {"w": 0.0}
        self.checkpoints: list[str] = []

    def build(self) -> int:
        return self.version

    def _check(self, call: str, version: int | None) -> None:
        if self.asleep:
            raise RuntimeError(f"FakeLearner.{call}: asleep")
        if version is not None and version != self.version:
            raise RuntimeError(f"FakeLearner.{call}: at version {self.version}, not {version}")

    def accumulate_runs(self, run_ids: Sequence[str], advantages: Sequence[float],
                        version: int | None, *payloads: Sequence[Any]) -> int:
        self._check("accumulate_runs", version)
        held = {r for p in payloads for r in p}
        lacking = sorted(set(run_ids) - held)
        if lacking:
            raise KeyError(f"FakeLearner.accumulate_runs: payloads lack runs {lacking}")
        self.grad.update(run_ids)
        return len(run_ids)

    def accumulate(self, micro_batch: Mapping[str, Any], version: int | None = None) -> int:
        self._check("accumulate", version)
        self.grad.update(micro_batch["run_ids"])
        return len(micro_batch["run_ids"])

    def take_gradients(self) -> dict[str, int]:
        out, self.grad = dict(self.grad), collections.Counter()
        return out

    def apply_step(self, grads: Sequence[Any], total: float, version: int) -> int:
        grads = [g.get() if isinstance(g, FakeRef) else g for g in grads]
        if version != self.version + 1:
            raise RuntimeError(f"FakeLearner.apply_step: at {self.version}, asked {version}")
        update: collections.Counter[str] = collections.Counter()
        for g in grads:
            update.update(g)
        self.ledger.applied[version].append(update)
        self.weights = {"w": self.weights["w"] + sum(update.values()) / total}
        self.version = version
        return version

    def get_weights(self) -> dict[str, float]:
        return dict(self.weights)

    def send_weights(self, spec: Any, version: int) -> int:
        raise RuntimeError("FakeLearner: broadcast weight sync needs process groups (Ray)")

    def reduce_step(self, group: Any, total: float, version: int) -> int:
        raise RuntimeError("FakeLearner: a collective reduction needs process groups (Ray)")

    def send_state(self, transfer: Any) -> int:
        raise RuntimeError("FakeLearner: a peer-to-peer state needs process groups (Ray)")

    def get_xlong_state(self) -> dict[str, Any]:
        return {"weights": dict(self.weights), "version": self.version, "optimizer": None}

    def set_xlong_state(self, state: Mapping[str, Any]) -> int:
        self.weights, self.version = dict(state["weights"]), int(state["version"])
        self.grad = collections.Counter()
        return self.version

    def wake_up(self, state: Any = None, after: Any = None) -> int:
        self.asleep = False
        if state is not None and int(state["version"]) != self.version:
            self.set_xlong_state(state)
        return self.version

    def sleep(self) -> None:
        self.grad = collections.Counter()
        self.asleep = True

    def take_step_stats(self, version: int) -> None:
        return None

    def save_checkpoint(self, path: str, files: Mapping[str, bytes] | None = None,
                        block: bool = False) -> str:
        """Write at once (the real one writes DCP shards in the background): the state, then
        the metadata file, then ``files`` into the parent, each renamed into place."""
        import io
        import json
        import os
        import pathlib

        import torch

        from ray_xlong.models.export import META_FILE

        def put(p: pathlib.Path, data: bytes) -> None:
            p.with_name(f".{p.name}.tmp").write_bytes(data)
            os.replace(p.with_name(f".{p.name}.tmp"), p)

        root = pathlib.Path(path)
        root.mkdir(parents=True, exist_ok=True)
        buf = io.BytesIO()
        torch.save(self.get_xlong_state(), buf)
        put(root / "state.pt", buf.getvalue())
        put(root / META_FILE, json.dumps({"version": self.version}).encode())
        for name, data in (files or {}).items():
            put(root.parent / name, data)
        self.checkpoints.append(str(root))
        return str(root)

    def wait_checkpoint(self) -> str | None:
        return self.checkpoints[-1] if self.checkpoints else None

    def load_checkpoint(self, path: str) -> int:
        import pathlib

        import torch

        return self.set_xlong_state(torch.load(pathlib.Path(path) / "state.pt",
                                               weights_only=False))

    def export_hf(self, out: str) -> str:
        raise RuntimeError("FakeLearner: no model to export")


@dataclasses.dataclass
class FakeCell:
    """One cell of a :class:`FakePool`."""

    index: int
    pg: None
    runner: FakeActor
    learner: FakeActor


class FakePool:
    """``protocols.CellHost`` over fake actors; every runner spools into ``spool_dir``."""

    def __init__(self, cells: int, *, spool_dir: str, ledger: Ledger, ray: FakeRay,
                 polls: int = 2) -> None:
        self.spool_dir, self.ledger, self.ray, self.polls = spool_dir, ledger, ray, polls
        self.cells = [FakeCell(c, None, self._spawn(c, "runner"), self._spawn(c, "learner"))
                      for c in range(cells)]
        self.placement_groups_created = cells
        self.initial_state = self.cells[0].learner.get_xlong_state.remote()
        self.initial_weights = self.cells[0].learner.get_weights.remote()
        self.unplaced: set[int] = set()
        self.actors_replaced = 0

    def _spawn(self, cell: int, which: str) -> FakeActor:
        obj = (FakeRunner(cell=cell, spool_dir=self.spool_dir, polls=self.polls)
               if which == "runner" else FakeLearner(self.ledger))
        return FakeActor(obj, f"cell {cell} {which}")

    def replace(self, cell: int, which: str, *, timeout_s: float = 120.0) -> FakeActor:
        if cell in self.unplaced:
            raise TimeoutError(f"cell {cell}: new {which} not up (its node is gone)")
        getattr(self.cells[cell], which).kill()
        actor = self._spawn(cell, which)
        setattr(self.cells[cell], which, actor)
        self.actors_replaced += 1
        return actor

    def placed(self, cell: int) -> bool:
        return cell not in self.unplaced

    def stop_actors(self, cell: int) -> None:
        self.cells[cell].runner.kill()
        self.cells[cell].learner.kill()

    def push_weights(self, cells: Sequence[int], weights: Any, version: int) -> list[int]:
        pushes = {c: self.cells[c].runner.set_weights.remote(weights, version) for c in cells}
        failed = []
        for cell, ref in pushes.items():
            try:
                self.ray.get(ref)
            except FakeRayError as exc:
                if not self.ray.lost(exc):
                    raise
                failed.append(cell)
        return failed

    def lose_node(self, cell: int) -> None:
        """``cell``'s node is gone: both actors dead, their values lost, not placeable."""
        self.unplaced.add(cell)
        for actor in (self.cells[cell].runner, self.cells[cell].learner):
            actor.lose_node()

    def restore_node(self, cell: int) -> None:
        """A node with the cell's resources is back: its placement group is placed again."""
        self.unplaced.discard(cell)

    def runner(self, cell: int) -> FakeRunner:
        """``cell``'s current runner object."""
        return self.cells[cell].runner.obj

    def kill_all(self) -> None:
        """Every actor dies (the driver and its cells are gone)."""
        for c in self.cells:
            c.runner.kill()
            c.learner.kill()


def fake_config(tmp_path: Any, *, mode: str = "elastic", cells: int = 3, steps: int = 3,
                checkpoint: bool = False, checkpoint_every: int = 1, **job: Any) -> Any:
    """A small ``CellJobConfig`` for fakes: ``steps`` steps of 2 groups × 2 runs, one run a
    micro-batch, a spool (and driver checkpoints) under ``tmp_path``."""
    from ray_xlong.cells.config import CellJobConfig, LearnerSettings
    from ray_xlong.cells.layout import CellLayout
    from ray_xlong.scheduling import SchedulingConfig

    shape = dict(total_steps=steps, batch_groups=2, runs_per_group=2, staleness_bound=1) | job
    return CellJobConfig(
        mode=mode, job=SchedulingConfig(**shape),
        layout=CellLayout(cells=cells, gpus_per_node=0),
        learner=LearnerSettings(model_dir="fake-model", micro_batch_tokens=1),
        slots_per_cell=2, poll_s=0.01, spool_dir=str(tmp_path / "spool"),
        checkpoint_dir=str(tmp_path / "ckpt") if checkpoint else None,
        checkpoint_every=checkpoint_every)


@dataclasses.dataclass
class FakeJob:
    """A config, fake cells over one spool, the ledger of what their learners applied."""

    cfg: Any
    ray: FakeRay
    ledger: Ledger
    pool: FakePool

    @classmethod
    def make(cls, cfg: Any, *, ledger: Ledger | None = None, polls: int = 2) -> FakeJob:
        ray, ledger = FakeRay(), ledger if ledger is not None else Ledger()
        pool = FakePool(cfg.layout.cells, spool_dir=cfg.spool_dir, ledger=ledger, ray=ray,
                        polls=polls)
        return cls(cfg, ray, ledger, pool)

    def actuator(self, **kwargs: Any) -> Any:
        """A ``RayActuator`` of this job on the fake cells (Ray calls through ``FakeRay``),
        with an :class:`OnceWhen` injector that only bounds the ticks (replace it to inject)."""
        from ray_xlong.cells.actuator import RayActuator
        from ray_xlong.cells.config import make_policy

        act = RayActuator(self.cfg, make_policy(self.cfg), self.pool, ray=self.ray, **kwargs)
        act.injector = OnceWhen()
        return act


class OnceWhen:
    """An actuator ``injector``: calls ``action(actuator)`` every tick until it returns
    something other than None (it fired), then ``then(actuator)`` every later tick. A job
    that has not ended after ``max_ticks`` fails (a recovery that loops, not a hung test)."""

    def __init__(self, action: Callable[[Any], Any] = lambda act: None,
                 then: Callable[[Any], Any] | None = None, *, max_ticks: int = 3000) -> None:
        self.action, self.then, self.max_ticks = action, then, max_ticks
        self.fired: Any = None
        """What ``action`` returned when it fired (None until then)."""
        self.ticks = self.ticks_after = 0

    def tick(self, act: Any) -> None:
        self.ticks += 1
        if self.ticks > self.max_ticks:
            raise AssertionError(f"the job did not end within {self.max_ticks} ticks "
                                 f"(version {act.m.version}, faults {act.faults})")
        if self.fired is None:
            self.fired = self.action(act)
            return
        self.ticks_after += 1
        if self.then is not None:
            self.then(act)
