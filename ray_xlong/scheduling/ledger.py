"""Group ledger: which runs may start, which groups are ready, which step trains which group.

The staleness bound ``b`` is kept by construction, in two rules:

* **Admission** — while the policy version is ``v``, at most ``(v + b + 1) * B`` groups may have
  started (rollout runs at most ``b`` steps ahead). A group's version is the version its first
  run started with (its oldest tokens), so it is the conservative one.
* **Selection** — step ``s`` must take every group of version ``<= s - b`` (*mandatory*), and
  every later step ``t`` must still be able to: for all ``t >= s`` the untaken groups of version
  ``<= t - b`` must fit in the places left in steps ``s..t`` (the *slack* of ``t`` stays >= 0).
  Ready groups are taken oldest version first while every slack they consume stays >= 0;
  admission keeps the slack of steps ``>= version + b`` non-negative by itself.

So every group is trained at a step ``s`` with ``s - version <= b``; :meth:`GroupLedger.take`
checks it anyway and raises :class:`StalenessError` if the arithmetic were ever broken.
Runs are numbered in start order; run ``r`` belongs to group ``r // G``.
"""

from __future__ import annotations

import heapq

from ray_xlong.scheduling.state import SchedulingConfig


class StalenessError(RuntimeError):
    """A group would be trained further than ``staleness_bound`` from its version."""


class GroupLedger:
    """Counts and queues for runs and groups; pure bookkeeping, no clock."""

    def __init__(self, config: SchedulingConfig) -> None:
        self.config = config
        n = config.total_groups
        self.next_run = 0
        self.group_version = [-1] * n
        self.runs_left = [config.runs_per_group] * n
        self.trained_step = [-1] * n
        self._ready: list[tuple[int, int]] = []  # (version, group), untaken
        self._untaken: dict[int, int] = {}  # version -> started groups not yet taken
        self._untaken_ready: dict[int, int] = {}  # version -> ready groups not yet taken
        self._rev = 0  # bumped on every change of the two tables above (``_plan``'s memo key)
        self._memo: tuple[tuple[int, int, int], int] | None = None

    def __getstate__(self) -> dict:
        """Pickled without ``_plan``'s memo (checkpoints hold the ledger)."""
        state = dict(self.__dict__)
        state["_memo"] = None
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.__dict__.setdefault("_rev", 0)   # a ledger pickled before the memo existed
        self._memo = None

    # -- admission -------------------------------------------------------------------------
    def admitted_groups(self, version: int) -> int:
        """Groups that may have started while the policy version is ``version``."""
        cfg = self.config
        return min(cfg.total_groups, (version + cfg.staleness_bound + 1) * cfg.batch_groups)

    def startable_runs(self, version: int) -> int:
        """Runs that may start now."""
        return max(0, self.admitted_groups(version) * self.config.runs_per_group - self.next_run)

    def start_runs(self, count: int, version: int) -> list[int]:
        """Hand out the next ``count`` run ids, stamping new groups with ``version``."""
        if count > self.startable_runs(version):
            raise ValueError(
                f"StartRuns.count: {count} exceeds the {self.startable_runs(version)} runs the "
                f"staleness bound admits at version {version}"
            )
        runs = list(range(self.next_run, self.next_run + count))
        g_size = self.config.runs_per_group
        for run in runs:
            group = run // g_size
            if run % g_size == 0:
                self.group_version[group] = version
                self._untaken[version] = self._untaken.get(version, 0) + 1
                self._rev += 1
        self.next_run += count
        return runs

    # -- completion ------------------------------------------------------------------------
    def run_ended(self, run: int) -> bool:
        """Record that ``run`` ended; True when its group became ready (all runs ended)."""
        group = run // self.config.runs_per_group
        if self.runs_left[group] <= 0:
            raise ValueError(f"run_ended.run: run {run} of group {group} ended twice")
        self.runs_left[group] -= 1
        if self.runs_left[group]:
            return False
        self._mark_ready(group)
        return True

    def _mark_ready(self, group: int) -> None:
        version = self.group_version[group]
        heapq.heappush(self._ready, (version, group))
        self._untaken_ready[version] = self._untaken_ready.get(version, 0) + 1
        self._rev += 1

    def resume_group(self, group: int, version: int, ended: int) -> None:
        """Put ``group`` (started at ``version``, ``ended`` of its runs ended) back as a resumed
        job had it (the simulator's ``StartState``); ready when every run ended."""
        self.group_version[group] = version
        self._untaken[version] = self._untaken.get(version, 0) + 1
        self._rev += 1
        self.runs_left[group] = self.config.runs_per_group - ended
        if not self.runs_left[group]:
            self._mark_ready(group)

    @property
    def ready_groups(self) -> int:
        """Ended groups not yet taken by a step."""
        return len(self._ready)

    # -- selection -------------------------------------------------------------------------
    def _plan(self, step: int, taken: int) -> int:
        """How many ready groups (oldest first) step ``step`` holding ``taken`` may take now
        (memoised until the next change of the tables: a simulation asks at every decision)."""
        key = (self._rev, step, taken)
        if self._memo is not None and self._memo[0] == key:
            return self._memo[1]
        b, batch = self.config.staleness_bound, self.config.batch_groups
        untaken = self._untaken
        horizon = max(untaken, default=step) + b
        versions = sorted(untaken)
        slack, cum, i = {}, 0, 0
        for t in range(step, horizon + 1):   # cum: untaken groups of version <= t - b
            while i < len(versions) and versions[i] <= t - b:
                cum += untaken[versions[i]]
                i += 1
            slack[t] = (t - step + 1) * batch - taken - cum
        total = 0
        for v in sorted(self._untaken_ready):
            ready = self._untaken_ready[v]
            window = [slack[t] for t in range(step, v + b)]
            k = max(0, min(ready, min(window, default=ready)))
            for t in range(step, v + b):
                slack[t] -= k
            total += k
            if k < ready:
                break
        self._memo = (key, total)
        return total

    def takeable(self, step: int, taken: int) -> int:
        """Groups step ``step`` (holding ``taken``) may take now."""
        return min(self._plan(step, taken), self.config.batch_groups - taken)

    def take(self, step: int, taken: int) -> list[int]:
        """Give step ``step`` every group it may take now (oldest version first)."""
        out = []
        for _ in range(self.takeable(step, taken)):
            version, group = heapq.heappop(self._ready)
            if step - version > self.config.staleness_bound:
                raise StalenessError(
                    f"group {group} (version {version}) at step {step} exceeds "
                    f"staleness_bound={self.config.staleness_bound}"
                )
            self._rev += 1
            for table in (self._untaken, self._untaken_ready):
                table[version] -= 1
                if not table[version]:
                    del table[version]
            self.trained_step[group] = step
            out.append(group)
        return out
