"""The runs an endpoint serves: open, record each model call, end as a token-exact AgentRun.

::

    open(group_id, run_id?)  ─► live run (refused while the cell drains)
    record(run, tag, prompt ids, result, ...)  ─► ModelCall c0, c1, ... (whole calls only)
    expire(now)             ─► a run past its wall clock or token budget is marked over budget:
                               its further calls are refused; its end reads ``timeout``
    end(run_id, reward, status) ─► AgentRun (a run with no call ends ``failed``: NoCallError)

Invariants: a call is recorded whole (prompt ids as sent to the engine, output ids and logprobs
as sampled, the version that generated them) or not at all; an ended run is gone (requests name
it in a 404); a draining registry refuses new runs and keeps serving live ones.
"""

from __future__ import annotations

import dataclasses
import time
import uuid

import numpy as np

from ray_xlong.checks import check_int
from ray_xlong.rollout.engine import GenerateResult
from ray_xlong.serving.messages import AgentTag
from ray_xlong.serving.prompts import AgentContext
from ray_xlong.trajectory.records import RUN_STATUSES, AgentRun, ModelCall


class RunNotFound(KeyError):
    """No live run of that id (never opened, or ended). The message names the run."""

    def __str__(self) -> str:
        return str(self.args[0])


class Draining(RuntimeError):
    """The cell drains: it takes no new runs."""


class OverBudget(RuntimeError):
    """The run passed its wall clock or token budget: no more calls (it ends ``timeout``)."""


class NoCallError(RuntimeError):
    """A run ended without a single model call (it is recorded ``failed``)."""


@dataclasses.dataclass(frozen=True, slots=True)
class RunLimits:
    """Budgets of one endpoint run; validated at construction."""

    wall_clock_s: float = 600.0
    """Seconds from open to the last call accepted; later calls are refused (``timeout``)."""
    max_run_tokens: int = 1 << 20
    """Generated tokens of the run (all agents); passing it refuses further calls."""

    def __post_init__(self) -> None:
        if not isinstance(self.wall_clock_s, (int, float)) or not 0 < self.wall_clock_s:
            raise ValueError(f"RunLimits.wall_clock_s must be > 0, got {self.wall_clock_s!r}")
        check_int("RunLimits", "max_run_tokens", self.max_run_tokens, minimum=1)


@dataclasses.dataclass(slots=True, eq=False)
class LiveRun:
    """A run being served (mutable; owned by the registry)."""

    run_id: str
    group_id: str
    opened: float
    calls: list[ModelCall] = dataclasses.field(default_factory=list)
    agents: dict[str, AgentContext] = dataclasses.field(default_factory=dict)
    parents: dict[tuple[str, str], str | None] = dataclasses.field(default_factory=dict)
    generated: int = 0
    over_budget: str | None = None
    extended: int = 0
    rewrites: int = 0
    last_answer: str = ""
    limits: RunLimits | None = None
    validated: dict[str, list] = dataclasses.field(default_factory=dict)
    """Per agent: the messages of its last answered chat request, as sent (schema-checked)."""


class RunRegistry:
    """Live runs of one endpoint (see module docstring)."""

    def __init__(self, *, limits: RunLimits = RunLimits()) -> None:
        self.limits = limits
        self.live: dict[str, LiveRun] = {}
        self.draining = False
        self.ended = 0
        self.abandoned: list[AgentRun] = []
        """Runs ended by :meth:`reap` (nobody ended them), kept for whoever collects them."""

    def open(self, *, group_id: str, run_id: str | None = None,
             limits: RunLimits | None = None) -> LiveRun:
        """A new live run (``limits``: its own budgets, default the registry's); raises
        :class:`Draining` or ValueError (a bad / live id)."""
        if self.draining:
            raise Draining("this cell is draining: it takes no new runs (live runs are still "
                           "served); open the run on another cell")
        if not isinstance(group_id, str) or not group_id:
            raise ValueError(f"group_id must be a non-empty string, got {group_id!r}")
        run_id = run_id if run_id is not None else uuid.uuid4().hex[:12]
        if not isinstance(run_id, str) or not run_id or "/" in run_id:
            raise ValueError(f"run_id must be a non-empty string without '/', got {run_id!r}")
        if run_id in self.live:
            raise ValueError(f"run_id {run_id!r} is already live")
        run = LiveRun(run_id, group_id, time.monotonic(), limits=limits or self.limits)
        self.live[run_id] = run
        return run

    def get(self, run_id: str) -> LiveRun:
        """The live run; raises :class:`RunNotFound` naming it."""
        run = self.live.get(run_id)
        if run is None:
            raise RunNotFound(f"run {run_id!r} is not live on this endpoint (never opened, or "
                              f"already ended)")
        return run

    def admit(self, run: LiveRun) -> None:
        """Raise :class:`OverBudget` when the run may make no more calls."""
        limits = run.limits or self.limits
        if run.over_budget is None:
            if time.monotonic() - run.opened > limits.wall_clock_s:
                run.over_budget = f"wall clock of {limits.wall_clock_s:g} s"
            elif run.generated >= limits.max_run_tokens:
                run.over_budget = f"token budget of {limits.max_run_tokens}"
        if run.over_budget is not None:
            raise OverBudget(f"run {run.run_id!r} is past its {run.over_budget}: no more model "
                             f"calls; end it (it ends 'timeout')")

    def max_tokens_left(self, run: LiveRun) -> int:
        """Tokens the run may still generate."""
        return max((run.limits or self.limits).max_run_tokens - run.generated, 0)

    def record(self, run: LiveRun, tag: AgentTag, prompt_ids: np.ndarray,
               result: GenerateResult, *, started: float) -> ModelCall:
        """Record one whole call; raises ValueError when the agent's parent changed."""
        key = (tag.agent_id, tag.kind)
        known = run.parents.setdefault(key, tag.parent)
        if known != tag.parent:
            raise ValueError(f"X-Xlong-Agent: agent {tag.agent_id!r} ({tag.kind}) was "
                             f"parent={known!r} before, now parent={tag.parent!r}")
        call = ModelCall(f"{run.run_id}/c{len(run.calls)}", tag.agent_id, tag.kind,
                         np.asarray(prompt_ids, np.int64), result.output_ids,
                         result.output_logprobs, result.policy_version,
                         parent_agent_id=tag.parent, start_time=started, end_time=time.time(),
                         run_id=run.run_id)
        run.calls.append(call)
        run.generated += int(result.output_ids.size)
        limit = (run.limits or self.limits).max_run_tokens
        if run.generated >= limit and run.over_budget is None:
            run.over_budget = f"token budget of {limit}"
        return call

    def check_parent(self, run: LiveRun, tag: AgentTag) -> None:
        """Raise ValueError (naming the header) when a parent names no agent of the run or
        differs from the agent's earlier calls."""
        known = run.parents.get((tag.agent_id, tag.kind), tag.parent)
        if known != tag.parent:
            raise ValueError(f"X-Xlong-Agent: agent {tag.agent_id!r} ({tag.kind}) was "
                             f"parent={known!r} before, now parent={tag.parent!r}")
        if tag.parent is not None and tag.parent not in {a for a, _ in run.parents}:
            raise ValueError(f"X-Xlong-Agent: parent {tag.parent!r} names no agent of run "
                             f"{run.run_id!r} that made a call")

    def reap(self, *, grace: float = 2.0) -> list[str]:
        """End runs nobody ended within ``grace`` × their wall clock: ``timeout`` (reward 0),
        or ``failed`` without calls; kept in :attr:`abandoned`. Returns their ids."""
        now, gone = time.monotonic(), []
        for run in list(self.live.values()):
            if now - run.opened > grace * (run.limits or self.limits).wall_clock_s:
                try:
                    self.abandoned.append(self.end(run.run_id, reward=0.0, status="timeout"))
                except NoCallError as exc:
                    self.abandoned.append(exc.run)   # type: ignore[attr-defined]
                gone.append(run.run_id)
        return gone

    def end(self, run_id: str, *, reward: float, status: str) -> AgentRun:
        """End a live run. Raises :class:`RunNotFound`; :class:`NoCallError` (the run is ended
        ``failed`` all the same; ``exc.run`` holds it); ValueError for a bad status / reward."""
        if status not in RUN_STATUSES:
            raise ValueError(f"status must be one of {RUN_STATUSES}, got {status!r}")
        run = self.get(run_id)
        if run.over_budget is not None and status == "finished":
            status = "timeout"
        del self.live[run_id]
        self.ended += 1
        if not run.calls:
            failed = AgentRun(run.run_id, run.group_id, [], 0.0, "failed")
            err = NoCallError(f"run {run_id!r} ended with no model call: recorded as failed")
            err.run = failed   # type: ignore[attr-defined]
            raise err
        return AgentRun(run.run_id, run.group_id, run.calls, float(reward), status)
