"""Cell state machine: validates every move and keeps the authoritative cell table and log.

Both actuators (the simulator, the Ray driver) own one :class:`CellMachine`. A policy's move goes
through :meth:`CellMachine.apply` *before* the actuator acts, so an illegal move fails loudly
with :class:`TransitionError` naming the move and the cell, and nothing half-happens.

Invariants checked on every transition:

* a cell leaves rollout / draining only with no live runs (never interrupts a run);
* runs start only on a ready rollout cell with free slots, within the staleness admission;
* a run ends on the cell that started it, once;
* steps start in order (step == version), one at a time; only idle trainers sync, at the
  current version; staleness <= bound (:class:`~ray_xlong.scheduling.ledger.GroupLedger`).

The machine also writes the event log (:class:`~ray_xlong.scheduling.events.Event`).

Faults (DESIGN.md 9, 10): a cell whose node is gone is *retired* (:meth:`CellMachine.retire_cell`):
it leaves every snapshot, and its live runs join a restart queue that the next ``StartRuns`` on
any cell drains first (same run ids, so a run is still trained exactly once). A cell whose
runner died restarts its live runs in place (:meth:`CellMachine.restart_run`). A machine pickles
whole; :meth:`CellMachine.resume` turns one saved at a step boundary into the state a new driver
starts from (every cell back in rollout, live runs still owed).
"""

from __future__ import annotations

import collections
from typing import Any, Callable, Sequence

from ray_xlong.scheduling.events import Event
from ray_xlong.scheduling.ledger import GroupLedger
from ray_xlong.scheduling.moves import Drain, JoinStep, Move, Reserve, StartRuns, StartTraining, Sync
from ray_xlong.scheduling.state import CellState, ClusterState, Role, SchedulingConfig

INF = float("inf")


class TransitionError(RuntimeError):
    """A move or actuator report that breaks the cell state machine."""


class CellMachine:
    """Mutable cell table + group ledger + event log; see the module docstring."""

    def __init__(self, config: SchedulingConfig, *, slots: Sequence[int]) -> None:
        if not slots or min(slots) < 1:
            raise ValueError(f"CellMachine.slots: need >= 1 cell with >= 1 slot, got {slots}")
        self.config = config
        self.ledger = GroupLedger(config)
        self.slots = tuple(slots)
        n = len(slots)
        self.role = [Role.ROLLOUT] * n
        self.step_of = [-1] * n
        self.ready_at = [0.0] * n
        self.live: list[dict[int, float]] = [{} for _ in range(n)]  # run -> start time
        self.run_cell: dict[int, int] = {}
        self.version = 0
        self.step = -1
        self.step_groups = 0
        self.step_starved = False
        self.retired: set[int] = set()
        self.restart: collections.deque[int] = collections.deque()  # orphaned runs, FIFO
        self.log: list[Event] = [Event(0.0, "start")]
        self.observed = 0  # events a learning policy has been shown (settle)
        self._cell_states: dict[int, tuple[tuple, CellState]] = {}  # snapshot's per-cell reuse

    def __getstate__(self) -> dict:
        """Pickled without the snapshot's reuse table (a cache; checkpoints hold the machine)."""
        state = dict(self.__dict__)
        state.pop("_cell_states", None)
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._cell_states = {}   # also for machines pickled before the table existed

    # -- moves -----------------------------------------------------------------------------
    def apply(self, move: Move, now: float) -> list[int]:
        """Validate and apply ``move``; returns the run ids started (StartRuns), else []."""
        if not 0 <= move.cell < len(self.slots):
            raise TransitionError(f"{move}: no cell {move.cell}")
        if move.cell in self.retired:
            raise TransitionError(f"{move}: cell {move.cell} is retired")
        if isinstance(move, StartRuns):
            return self._start_runs(move, now)
        if isinstance(move, Drain):
            self._expect(move, Role.ROLLOUT)
            self._set_role(move.cell, Role.DRAINING, now)
        elif isinstance(move, Reserve):
            self._enter_training(move, now)
        elif isinstance(move, StartTraining):
            if self.step >= 0 or move.step != self.version or self.done:
                raise TransitionError(
                    f"{move}: steps start in order, one at a time "
                    f"(version {self.version}, step in progress {self.step})"
                )
            self._enter_training(move, now)
            self.step, self.step_groups, self.step_starved = move.step, 0, False
            self.step_of[move.cell] = move.step
            self.log.append(Event(now, "step_started", cell=move.cell, step=move.step))
        elif isinstance(move, JoinStep):
            if self.step < 0 or move.step != self.step:
                raise TransitionError(f"{move}: step in progress is {self.step}")
            self._enter_training(move, now)
            self.step_of[move.cell] = move.step
            self.log.append(Event(now, "step_joined", cell=move.cell, step=move.step))
        elif isinstance(move, Sync):
            self._expect(move, Role.TRAINING)
            if self.step_of[move.cell] >= 0 or move.version != self.version:
                raise TransitionError(
                    f"{move}: only an idle trainer syncs, to the current version {self.version}"
                )
            self._set_role(move.cell, Role.SYNCING, now)
        else:
            raise TransitionError(f"unknown move {move!r}")
        return []

    def _expect(self, move: Move, *roles: Role) -> None:
        if self.role[move.cell] not in roles:
            names = "/".join(r.value for r in roles)
            raise TransitionError(f"{move}: cell {move.cell} is {self.role[move.cell].value}, not {names}")

    def _enter_training(self, move: Move, now: float) -> None:
        cell = move.cell
        if self.role[cell] is Role.TRAINING:
            if self.step_of[cell] >= 0:
                raise TransitionError(f"{move}: cell {cell} is already training step {self.step_of[cell]}")
            return
        self._expect(move, Role.ROLLOUT, Role.DRAINING)
        if self.live[cell]:
            raise TransitionError(
                f"{move}: cell {cell} has {len(self.live[cell])} live runs; "
                "a cell leaves rollout only when empty"
            )
        self._set_role(cell, Role.TRAINING, now)

    def _set_role(self, cell: int, role: Role, now: float) -> None:
        self.role[cell] = role
        self.log.append(Event(now, "role", cell=cell, role=role.value))

    def _start_runs(self, move: StartRuns, now: float) -> list[int]:
        cell = move.cell
        self._expect(move, Role.ROLLOUT)
        if move.count < 1 or move.count > self.slots[cell] - len(self.live[cell]):
            raise TransitionError(
                f"{move}: count must be 1..{self.slots[cell] - len(self.live[cell])} (free slots)"
            )
        again = [self.restart.popleft() for _ in range(min(move.count, len(self.restart)))]
        runs = again + (self.ledger.start_runs(move.count - len(again), self.version)
                        if move.count > len(again) else [])
        g_size = self.config.runs_per_group
        for run in runs:
            self.live[cell][run] = now
            self.run_cell[run] = cell
            kind = "run_restarted" if run in again else "run_started"
            self.log.append(
                Event(now, kind, cell=cell, run=run, group=run // g_size, version=self.version)
            )
        return runs

    # -- actuator reports ------------------------------------------------------------------
    def run_ended(self, cell: int, run: int, now: float) -> bool:
        """A run ended; True when its group became ready. Raises if it was not live on ``cell``."""
        if self.run_cell.get(run) != cell or run not in self.live[cell]:
            raise TransitionError(
                f"run_ended: run {run} is not live on cell {cell} (started on {self.run_cell.get(run)})"
            )
        del self.live[cell][run]
        self.log.append(Event(now, "run_ended", cell=cell, run=run, group=run // self.config.runs_per_group))
        return self.ledger.run_ended(run)

    def restart_run(self, cell: int, run: int, now: float) -> None:
        """Run ``run`` started again on its own cell (its runner was replaced)."""
        if self.run_cell.get(run) != cell or run not in self.live[cell]:
            raise TransitionError(f"restart_run: run {run} is not live on cell {cell}")
        del self.live[cell][run]
        self.live[cell][run] = now
        self.log.append(Event(now, "run_restarted", cell=cell, run=run,
                              group=run // self.config.runs_per_group, version=self.version))

    def cell_lost(self, cell: int, what: str, now: float) -> None:
        """Log that an actor of ``cell`` died (``what``: runner / learner / node)."""
        self.log.append(Event(now, "cell_lost", cell=cell, role=what))

    def retire_cell(self, cell: int, now: float) -> list[int]:
        """``cell`` leaves the job (its node is gone). Returns its live runs, which now wait in
        the restart queue; the actuator drops the cell from the step it trained, if any."""
        if cell in self.retired:
            raise TransitionError(f"retire_cell: cell {cell} is already retired")
        if len(self.retired) + 1 >= len(self.slots):
            raise TransitionError(f"retire_cell: cell {cell} is the last cell of the job")
        orphans = list(self.live[cell])
        self.live[cell].clear()
        for run in orphans:
            del self.run_cell[run]
        self.restart.extend(orphans)
        self.retired.add(cell)
        self.step_of[cell] = -1
        self.ready_at[cell] = INF
        self.log.append(Event(now, "cell_retired", cell=cell))
        return orphans

    def rebuild_cell(self, cell: int, now: float) -> None:
        """A retired ``cell`` is back (fresh actors on current weights), in rollout."""
        if cell not in self.retired:
            raise TransitionError(f"rebuild_cell: cell {cell} is not retired")
        self.retired.discard(cell)
        self.ready_at[cell] = now
        self.log.append(Event(now, "cell_rebuilt", cell=cell))
        self._set_role(cell, Role.ROLLOUT, now)

    def resume(self, now: float) -> list[tuple[int, int]]:
        """Turn a machine saved at a step boundary into a new driver's starting state.

        Every cell is back in rollout (draining cells stay draining) and ready; retired cells
        come back (the new driver builds every cell). Returns ``(cell, run)`` of the runs that
        were live when the machine was saved: the driver either reports them ended (their result
        survived in the spool) or restarts them in place.
        """
        if self.step >= 0:
            raise TransitionError(f"resume: saved during step {self.step}; save at a step "
                                  "boundary")
        self.log.append(Event(now, "resumed", version=self.version))
        for cell in sorted(self.retired):
            self.rebuild_cell(cell, now)
        for cell, role in enumerate(self.role):
            self.step_of[cell] = -1
            self.ready_at[cell] = now
            if role in (Role.TRAINING, Role.SYNCING):
                self._set_role(cell, Role.ROLLOUT, now)
        return [(cell, run) for cell, live in enumerate(self.live) for run in live]

    def busy_until(self, cell: int, ready_at: float) -> None:
        """The actuator's switch / sync on ``cell`` ends at ``ready_at``."""
        self.ready_at[cell] = ready_at

    def cell_ready(self, cell: int, now: float) -> None:
        """A switch or sync ended; a syncing cell returns to rollout."""
        self.log.append(Event(now, "ready", cell=cell))
        if self.role[cell] is Role.SYNCING:
            self._set_role(cell, Role.ROLLOUT, now)

    def take_groups(self) -> list[int]:
        """Groups the step in progress may take now (empty when none is in progress)."""
        if self.step < 0:
            return []
        groups = self.ledger.take(self.step, self.step_groups)
        self.step_groups += len(groups)
        return groups

    def set_starved(self, starved: bool, now: float) -> None:
        """The actuator reports whether the step in progress waits for groups."""
        if starved and not self.step_starved:
            self.log.append(Event(now, "step_starved", step=self.step))
        self.step_starved = starved

    def end_step(self, now: float) -> None:
        """The step in progress is applied: version + 1, its cells become idle trainers."""
        if self.step < 0 or self.step_groups != self.config.batch_groups:
            raise TransitionError(f"end_step: step {self.step} holds {self.step_groups} groups")
        self.log.append(Event(now, "step_ended", step=self.step, version=self.version + 1))
        self.step_of = [-1 if s == self.step else s for s in self.step_of]
        self.version, self.step, self.step_groups, self.step_starved = self.version + 1, -1, 0, False
        if self.done:
            self.log.append(Event(now, "finish"))

    def micro_batch_done(self, cell: int, now: float) -> None:
        """A training cell finished a micro-batch of the step in progress (logged)."""
        self.log.append(Event(now, "micro_batch", cell=cell, step=self.step))

    # -- the settle loop (the simulator and the Ray actuator both run this) --------------------
    def settle(self, policy: Any, clock: Callable[[], float], *,
               apply: Callable[[Move, list[int], bool], None], after_round: Callable[[], None],
               max_rounds: int) -> None:
        """Decide → apply → act until ``policy`` has no more moves at this instant.

        Each round: a policy with an ``observe(events)`` method is first shown the events
        logged since its last look (learning policies: ``scheduling.online``,
        ``sim.planner``); then ``policy.decide(snapshot, last event)``; every move is validated and
        applied here, then ``apply(move, runs started, the cell was training)`` acts on it
        (a clock's delays, or Ray actors); ``after_round()`` (the caller's training) runs once
        per round.

        Raises:
            RuntimeError: still moving after ``max_rounds`` rounds (a policy that never settles).
        """
        observe = getattr(policy, "observe", None)
        for _ in range(max_rounds):
            now = clock()
            if observe is not None:  # a learning policy sees every event once, in order
                seen = getattr(self, "observed", 0)
                observe(self.log[seen:])
                self.observed = len(self.log)
            moves = policy.decide(self.snapshot(now), self.log[-1])
            if not moves:
                return
            for move in moves:
                was_training = self.role[move.cell] is Role.TRAINING
                apply(move, self.apply(move, now), was_training)
            after_round()
        raise RuntimeError(f"{policy.name}: still moving after {max_rounds} rounds at {clock()}")

    # -- read API --------------------------------------------------------------------------
    def runs_ended(self) -> int:
        """Runs that ended so far (a run restarted after a loss counts when it ends)."""
        return sum(1 for e in self.log if e.kind == "run_ended")

    def live_runs(self, cell: int) -> tuple[int, ...]:
        """Runs live on ``cell``, oldest first."""
        return tuple(self.live[cell])

    def pretty_print(self) -> str:
        """One line per cell (role, step, live runs, ready time) and the step / version line;
        printed and returned."""
        lines = [f"version {self.version}  step {self.step} ({self.step_groups}/"
                 f"{self.config.batch_groups} groups{', starved' if self.step_starved else ''})"
                 f"  events {len(self.log)}"]
        for c in range(len(self.slots)):
            state = "retired" if c in self.retired else self.role[c].value
            step = f" step {self.step_of[c]}" if self.step_of[c] >= 0 else ""
            ready = " busy" if self.ready_at[c] == INF else ""
            lines.append(f"  cell {c}: {state:<9}{step} live {len(self.live[c])}/"
                         f"{self.slots[c]}{ready}")
        text = "\n".join(lines)
        print(text)
        return text

    @property
    def done(self) -> bool:
        """Every step trained."""
        return self.version >= self.config.total_steps

    # -- snapshot --------------------------------------------------------------------------
    def snapshot(self, now: float) -> ClusterState:
        """Immutable picture for a policy. A cell whose fields did not change since the last
        snapshot keeps its ``CellState`` object (a simulation takes one at every decision)."""
        cells = []
        reuse = self._cell_states
        for c in range(len(self.slots)):
            if c in self.retired:
                continue
            live = self.live[c]
            key = (self.role[c], len(live), self.slots[c], self.step_of[c], self.ready_at[c],
                   next(iter(live.values()), INF), next(reversed(live.values()), INF))
            kept = reuse.get(c)
            if kept is None or kept[0] != key:
                kept = reuse[c] = (key, CellState(c, *key))
            cells.append(kept[1])
        cells = tuple(cells)
        ledger = self.ledger
        next_step = self.step if self.step >= 0 else self.version
        return ClusterState(
            time=now, config=self.config, cells=cells, version=self.version, step=self.step,
            step_groups=self.step_groups, step_starved=self.step_starved,
            ready_groups=ledger.ready_groups,
            takeable_groups=ledger.takeable(next_step, self.step_groups) if not self.done else 0,
            startable_runs=ledger.startable_runs(self.version) + len(self.restart),
            unstarted_runs=self.config.total_runs - ledger.next_run + len(self.restart),
            live_runs=sum(c.live_runs for c in cells),
        )
