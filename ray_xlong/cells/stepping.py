"""``SteppingActuator``: the cell actuator advanced one optimizer step per call.

``RayActuator.run`` drives a whole job; an RLlib ``Algorithm`` calls ``training_step`` once per
step, so this wrapper turns the actuator's loop one step at a time (composition: the actuator
reports runs and steps to a :class:`StepRecorder`; no hooks overridden). Runs keep going
between calls — in async and elastic modes the next step's runs are already live when
``advance`` returns::

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
from typing import Any, Sequence

import numpy as np

from ray_xlong.cells.actuator import RayActuator
from ray_xlong.cells.learner_group import MicroBatch
from ray_xlong.rollout.run_stats import AgentStepStats, RunStats, agent_step_stats
from ray_xlong.scheduling import Role
from ray_xlong.trajectory import BatchStats
from ray_xlong.trajectory.per_run import RunDigest


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
    agent: AgentStepStats | None = None
    """Agent statistics of the runs the step trained (``rollout.run_stats``)."""


class StepRecorder:
    """A :class:`~ray_xlong.cells.actuator.StepObserver` keeping what a step report needs:
    rewards of delivered runs, and per step the tokens, trajectories and worst staleness."""

    def __init__(self) -> None:
        self.rewards: dict[str, float] = {}
        self.run_stats: dict[str, RunStats] = {}
        self.per_step: dict[int, collections.Counter] = collections.defaultdict(
            collections.Counter)

    def delivered(self, digest: RunDigest) -> None:
        self.rewards[digest.run_id] = digest.reward
        if digest.agent is not None:      # the harness's counts, taken where the run ended
            self.run_stats[digest.run_id] = digest.agent

    def taken(self, step: int, micro: Sequence[MicroBatch], stats: BatchStats) -> None:
        self.per_step[step].update(
            tokens_trained=sum(mb.targets for mb in micro),
            unique_tokens=stats.unique_tokens, total_tokens=stats.total_tokens,
            trajectories_kept=stats.trajectories_kept,
            trajectories_dropped=stats.trajectories_dropped)

    def staleness(self, step: int, stale: int) -> None:
        worst = self.per_step[step]
        worst["staleness_max"] = max(worst["staleness_max"], stale)


class SteppingActuator:
    """One step per :meth:`advance` (module docstring): a :class:`RayActuator` with a
    :class:`StepRecorder` as its observer."""

    def __init__(self, config: Any, policy: Any, pool: Any, *, version: int, state_ref: Any,
                 weights_ref: Any) -> None:
        self.recorder = StepRecorder()
        self.actuator = RayActuator(config, policy, pool, version_offset=version,
                                    observer=self.recorder)
        self.state_ref, self.weights_ref = state_ref, weights_ref
        self.next_step = 0
        """The scheduler step the next :meth:`advance` reports (a step applied while something
        else ticked the actuator, e.g. an evaluation, is reported by the next call at once)."""

    @property
    def m(self) -> Any:
        """The actuator's cell machine (its event log: ``m.log``)."""
        return self.actuator.m

    @property
    def learners(self) -> Any:
        """The elastic learner group (``state_ref`` of the current version)."""
        return self.actuator.learners

    def start(self) -> None:
        """Reset every cell to the start state and let the policy start runs."""
        self.actuator.start(self.state_ref, self.weights_ref)
        self.next_step = self.actuator.m.version
        self.actuator.act()

    def advance(self) -> StepReport:
        """Drive the cells until one more optimizer step is applied."""
        act = self.actuator
        t, step = time.monotonic(), self.next_step
        while act.m.version <= step:
            if act.m.done:
                raise RuntimeError(f"SteppingActuator: the job's {act.cfg.job.total_steps} "
                                   f"steps are done (raise xlong(max_steps=...))")
            act.tick()
        self.next_step = step + 1
        return self._report(step, time.monotonic() - t)

    def _report(self, step: int, step_s: float) -> StepReport:
        act, rec = self.actuator, self.recorder
        run_ids = act.trained.get(step, [])
        rewards = [rec.rewards.pop(r) for r in run_ids]
        agent = agent_step_stats([rec.run_stats.pop(r) for r in run_ids if r in rec.run_stats])
        s = rec.per_step.pop(step, collections.Counter())
        roles = collections.Counter(r.value for r in act.m.role)
        return StepReport(
            version=act.state.version_offset + step + 1,    # the learner group's, then
            reward_mean=float(np.mean(rewards)) if rewards else 0.0, runs=len(rewards),
            tokens_trained=s["tokens_trained"], unique_tokens=s["unique_tokens"],
            total_tokens=s["total_tokens"], trajectories_kept=s["trajectories_kept"],
            trajectories_dropped=s["trajectories_dropped"], staleness_max=s["staleness_max"],
            cells_by_role={r.value: roles.get(r.value, 0) for r in Role},
            gpu_busy_frac=act.result().gpu_busy_frac, step_s=step_s, elapsed_s=act.now(),
            agent=agent)
