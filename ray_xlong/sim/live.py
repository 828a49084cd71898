"""The live part of a job as its events tell it, and the planning simulation's start from it.

```
events ──observe──► LiveJob: groups in flight [version, runs started, runs ended],
                    live runs (group, cell, start), ended groups (version, group)
snapshot + run-length quantiles ──start_state──► StartState (sim.simulator): every k-th group
                    in flight or ready, rebased to the snapshot's time and version; each live
                    run's time left drawn given its age
```

Invariants: O(1) work per event; a start state is built at a step boundary (no step in
progress) and holds exactly the snapshot's live runs per cell and ready groups at full scale.
"""

from __future__ import annotations

import bisect
import random

from ray_xlong.scheduling.state import ClusterState
from ray_xlong.sim.simulator import StartState


class LiveJob:
    """The live part of the job as the events tell it: groups in flight with their versions,
    live runs with their cells and starts, the ended groups (the untaken ones are the newest:
    steps take the oldest first). O(1) per event; :meth:`start_state` builds the planning
    simulation's start from it and a snapshot."""

    def __init__(self) -> None:
        self.runs: dict[int, tuple[int, int, float]] = {}  # live run -> (group, cell, start)
        self.groups: dict[int, list[int]] = {}  # group in flight -> [version, started, ended]
        self.ended: list[tuple[int, int]] = []  # (version, group) of ended groups
        self.group_size = 0

    def observe(self, events) -> None:
        """Fold new events in (log order)."""
        for e in events:
            if e.kind in ("run_started", "run_restarted"):
                if e.run not in self.runs and e.kind == "run_started":
                    self.groups.setdefault(e.group, [e.version, 0, 0])[1] += 1
                self.runs[e.run] = (e.group, e.cell, e.time)
            elif e.kind == "run_ended":
                self.runs.pop(e.run, None)
                g = self.groups.get(e.group)
                if g is None:
                    continue
                g[2] += 1
                if self.group_size and g[2] >= self.group_size:
                    self.ended.append((g[0], e.group))
                    del self.groups[e.group]

    def start_state(self, state: ClusterState, quantiles: list[float], *, every: int,
                    max_groups: int, rng: random.Random) -> StartState:
        """The planning simulation's start: every ``every``-th group in flight or ready (the
        planning scale), rebased to ``state``'s time and version; each live run's time left
        drawn from ``quantiles`` (sorted run durations) given its age."""
        self.group_size = self.group_size or state.config.runs_per_group
        g_size = self.group_size
        ready = sorted(self.ended)[max(0, len(self.ended) - state.ready_groups):] \
            if state.ready_groups else []
        self.ended = ready  # the others were taken by steps
        rows = [(g, v, g_size, 0) for v, g in ready]
        rows += [(g, v, ended, g_size - started) for g, (v, started, ended) in self.groups.items()]
        rows.sort()
        keep = {g for g, *_ in rows[::every][:max_groups]}
        index = {g: i for i, g in enumerate(sorted(keep))}
        where = {c.cell: i for i, c in enumerate(state.cells)}
        live = []
        for g, cell, began in self.runs.values():
            if g in index and cell in where:
                age = state.time - began
                j = bisect.bisect_right(quantiles, age)
                left = rng.choice(quantiles[j:]) - age if j < len(quantiles) else \
                    0.05 * max(age, quantiles[-1] if quantiles else 0.0)
                live.append((index[g], where[cell], began - state.time, left))
        groups = tuple((v - state.version, ended, unstarted)
                       for g, v, ended, unstarted in rows if g in index)
        return StartState(groups=groups, live=tuple(live),
                          roles=tuple(c.role for c in state.cells),
                          ready_at=tuple(c.ready_at - state.time for c in state.cells))
