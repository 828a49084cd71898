"""``SteppingActuator``: the cell actuator advanced one optimizer step per call.

``RayActuator.run`` drives a whole job; an RLlib ``Algorithm`` calls ``training_step`` once per
step, so this subclass splits the loop (runs keep going between calls — in async and elastic
modes the next step's runs are already live when ``advance`` returns)::

    start()      cells to the start state (weights + Adam + version v0), runs start
    advance()    poll → train → act until one more step is applied  → StepReport
    advance()    …

A job may start at version ``v0 > 0`` (restored from a checkpoint): the scheduler counts its
own steps from 0, the learner group and the engines carry the real version (``v0 + step``).
Per step it also keeps what RLlib users read in a result: reward, runs, tokens trained,
unique / total tokens, trajectories kept / dropped, token staleness, cells by role, busy share.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from typing import Any

import numpy as np
import ray

from ray_xlong.cells.actuator import RayActuator
from ray_xlong.cells.learner_group import ElasticLearnerGroup
from ray_xlong.scheduling import Role


@dataclasses.dataclass(frozen=True, slots=True)
class StepReport:
    """What one optimizer step trained and how the cells spent the time."""

    version: int
    """Policy version after the step (= steps applied, counting restored ones)."""
    reward_mean: float
    """Mean reward of the runs the step trained."""
    runs: int
    """Runs the step trained."""
    tokens_trained: int
    """Loss targets (model-generated tokens, count-once) of the step."""
    unique_tokens: int
    """Tokens of the step's prefix trees (each shared prefix once)."""
    total_tokens: int
    """Tokens summed over the kept trajectories (shared prefixes repeated)."""
    trajectories_kept: int
    """Trajectories trained (≤ K per run)."""
    trajectories_dropped: int
    """Trajectories dropped by the K cap."""
    staleness_max: int
    """Max over trained tokens of (step − version that generated the token)."""
    cells_by_role: dict[str, int]
    """Cells per role when the step ended."""
    gpu_busy_frac: float
    """Busy cell-time ÷ (cells × wall time) since the job started."""
    step_s: float
    """Wall seconds of this ``advance`` call."""
    elapsed_s: float
    """Wall seconds since the job started."""


class _OffsetGroup(ElasticLearnerGroup):
    """The elastic learner group starting at version ``offset`` (scheduler step 0 = offset)."""

    def __init__(self, learners: list[Any], *, offset: int) -> None:
        super().__init__(learners, durable=True)
        self.offset = offset
        self.version = offset
        self.learner_version = [offset] * len(learners)

    def begin(self, step: int) -> None:
        super().begin(step + self.offset)


class SteppingActuator(RayActuator):
    """One step per :meth:`advance` (module docstring)."""

    def __init__(self, config: Any, policy: Any, pool: Any, *, version: int, state_ref: Any,
                 weights_ref: Any) -> None:
        super().__init__(config, policy, pool)
        self.offset, self.state_ref, self.weights_ref = version, state_ref, weights_ref
        self.rewards: dict[str, float] = {}
        self.per_step: dict[int, collections.Counter] = collections.defaultdict(
            collections.Counter)

    def start(self) -> None:
        """Reset every cell to the start state and let the policy start runs."""
        calls = []
        for cell in self.cells:
            calls += [cell.learner.set_xlong_state.remote(self.state_ref),
                      cell.learner.sleep.remote(),
                      cell.runner.resume.remote(self.weights_ref, self.offset)]
        ray.get(calls)
        self.group = _OffsetGroup([c.learner for c in self.cells], offset=self.offset)
        self.t0 = time.monotonic()
        for c in range(len(self.cells)):
            self._watch_runs(c)
        self.act()

    def advance(self) -> StepReport:
        """Drive the cells until one more optimizer step is applied."""
        t, step = time.monotonic(), self.m.version
        while self.m.version == step:
            if self.m.done:
                raise RuntimeError(f"SteppingActuator: the job's {self.cfg.job.total_steps} "
                                   f"steps are done (raise xlong(max_steps=...))")
            self.poll()
            self._check_retired()
            self.train()
            self.act()
        return self._report(step, time.monotonic() - t)

    # -- hooks on the actuator ---------------------------------------------------------------
    def _deliver(self, cell: int, results: list) -> None:
        for res in results:
            self.rewards[res.run.run_id] = float(res.run.reward)
        super()._deliver(cell, results)

    @property
    def version_offset(self) -> int:
        """Scheduler step 0 is policy version ``offset`` (the algorithm's restored version)."""
        return self.offset

    def _on_taken(self, micro: list, stats) -> None:
        self.per_step[self.m.step].update(
            tokens_trained=sum(mb.targets for mb in micro),
            unique_tokens=stats.unique_tokens, total_tokens=stats.total_tokens,
            trajectories_kept=stats.trajectories_kept,
            trajectories_dropped=stats.trajectories_dropped)

    def _on_staleness(self, stale: int) -> None:
        super()._on_staleness(stale)
        worst = self.per_step[self.m.step]
        worst["staleness_max"] = max(worst["staleness_max"], stale)

    def _report(self, step: int, step_s: float) -> StepReport:
        run_ids = self.trained.get(step, [])
        rewards = [self.rewards.pop(r) for r in run_ids]
        s = self.per_step.pop(step, collections.Counter())
        roles = collections.Counter(r.value for r in self.m.role)
        return StepReport(
            version=self.offset + self.m.version,
            reward_mean=float(np.mean(rewards)) if rewards else 0.0, runs=len(rewards),
            tokens_trained=s["tokens_trained"], unique_tokens=s["unique_tokens"],
            total_tokens=s["total_tokens"], trajectories_kept=s["trajectories_kept"],
            trajectories_dropped=s["trajectories_dropped"], staleness_max=s["staleness_max"],
            cells_by_role={r.value: roles.get(r.value, 0) for r in Role},
            gpu_busy_frac=self.result().gpu_busy_frac, step_s=step_s, elapsed_s=self.now())
