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
exactly one chunk; an actor that dies raises :class:`CellActorDied` naming the cell (no silent
loss; recovery is not implemented).
"""

from __future__ import annotations

import collections
import time
from typing import Any

import ray

from ray_xlong.rllib.cells import CellPool
from ray_xlong.rllib.config import CellJobConfig
from ray_xlong.rllib.learner_group import ElasticLearnerGroup, MicroBatch, chunk_with_stats
from ray_xlong.rllib.metrics import RayResult
from ray_xlong.scheduling import (CellMachine, Drain, Event, JoinStep, Policy, Reserve, Role,
                                  StartRuns, StartTraining, Sync)

INF = float("inf")
MAX_ROUNDS = 16


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
        self.group = ElasticLearnerGroup([c.learner for c in self.cells])
        self.pending: dict[Any, tuple[str, int, float]] = {}
        self.ended: dict[int, list] = collections.defaultdict(list)  # group -> AgentRuns
        self.queue: collections.deque[tuple[MicroBatch, bool]] = collections.deque()
        self.in_flight: dict[int, float] = {}  # cell -> dispatch time
        self.awake: set[int] = set()
        self.stats = collections.defaultdict(list)
        self.trained: dict[int, list[str]] = {}  # step -> run ids it trained
        self.token_staleness = 0
        self.t0 = time.monotonic()

    def now(self) -> float:
        return time.monotonic() - self.t0

    # -- the loop ----------------------------------------------------------------------------
    def run(self) -> RayResult:
        """Run the job to its last step; returns the event log and measurements."""
        self._reset_cells()
        self.t0 = time.monotonic()
        for c in range(len(self.cells)):
            self._watch_runs(c)
        self.act()
        while not self.m.done:
            self.poll()
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
            kind, cell, issued = self.pending.pop(ref)
            try:
                value = ray.get(ref)
            except ray.exceptions.RayActorError as exc:
                raise CellActorDied(f"cell {cell}: actor died during {kind}: {exc}") from exc
            getattr(self, f"_on_{kind}")(cell, value, issued)

    def _on_ended(self, cell: int, results: list, issued: float) -> None:
        for res in results:
            run = int(res.run.run_id[1:])
            self.m.run_ended(cell, run, self.now())
            self.ended[run // self.cfg.job.runs_per_group].append(res.run)
        self._watch_runs(cell)

    def _on_switch(self, cell: int, value: Any, issued: float) -> None:
        self.stats["switch_s"].append(self.now() - issued)
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
            c.runner.start_runs.remote([self.cfg.work.spec(r, runs_per_group=g) for r in runs])
        elif isinstance(move, Drain):
            c.runner.drain.remote()
        elif isinstance(move, (Reserve, StartTraining, JoinStep)):
            if isinstance(move, StartTraining):
                self.group.begin(move.step)
            after = None
            if not was_training:
                self.m.busy_until(cell, INF)
                after = c.runner.suspend.remote()
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
            ref = c.runner.resume.remote(self.group.weights_ref, self.group.version, slept)
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
        t = time.perf_counter()
        self.stats["step_members"].append(len(self.group.members))
        self.group.finish()
        weights, version = self.group.weights_ref, self.group.version
        pushes = [self.cells[c].runner.set_weights.remote(weights, version)
                  for c, role in enumerate(self.m.role) if role is not Role.TRAINING]
        ray.get(pushes)
        self.stats["step_finish_s"].append(time.perf_counter() - t)
        self.m.end_step(self.now())

    def result(self) -> RayResult:
        """Measurements of the finished job."""
        led = self.m.ledger
        return RayResult(
            mode=self.policy.name, makespan_s=self.now(), cells=len(self.cells),
            slots_per_cell=self.cfg.slots_per_cell,
            staleness=tuple(s - v for s, v in zip(led.trained_step, led.group_version)),
            token_staleness_max=self.token_staleness, trained_step=tuple(led.trained_step),
            trained_runs=tuple(tuple(self.trained.get(s, ())) for s in range(self.m.version)), events=tuple(self.m.log),
            timings={k: tuple(v) for k, v in self.stats.items()},
            placement_groups_created=self.pool.placement_groups_created)
