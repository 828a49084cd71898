"""External agents as tasks: any program that talks to an OpenAI base URL, plus a scorer.

An :class:`AgentTask` is an agent and the task it is given::

    agent(base_url, task) -> None          an async Python callable (use ``openai.AsyncOpenAI``:
                                           it shares the endpoint's event loop), or
    command = ("python", "my_agent.py")    a subprocess with OPENAI_BASE_URL, OPENAI_API_KEY and
                                           XLONG_TASK (the task as JSON) in its environment
    scorer(task, outcome) -> float         the reward (``AgentOutcome``: the main agent's last
                                           answer, the subprocess's stdout, the call count)

:func:`run_agent` opens a run on the endpoint, runs the agent to its end and ends the run::

    agent returns (exit 0)          -> finished, reward = scorer(...)
    wall clock passed               -> timeout (the agent is cancelled / killed), scored
    token budget passed             -> the endpoint refuses further calls (409); the agent's
                                       error is then a timeout, scored
    agent raises (exit != 0)        -> failed with its error (stderr tail), reward 0
    scorer raises / not finite      -> failed (score_error)
    no model call at all            -> failed (no_call), named

The result is the harness's :class:`~ray_xlong.rollout.harness.RunResult`, so endpoint runs
join the same trajectory processing as built-in ones.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import os
import time
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Sequence

from ray_xlong.rollout.run_records import RunInfo, RunResult
from ray_xlong.rollout.limits import bounded
from ray_xlong.serving.runs import NoCallError, RunLimits

if TYPE_CHECKING:                    # the endpoint pulls in FastAPI and vLLM's protocol models
    from ray_xlong.serving.app import Endpoint

AgentFn = Callable[[str, Any], Awaitable[None]]
"""``agent(base_url, task) -> None``."""


@dataclasses.dataclass(frozen=True, slots=True)
class AgentOutcome:
    """What a scorer sees of a run."""

    answer: str
    """The text of the last response to the main agent."""
    stdout: str
    """The subprocess's standard output ("" for a callable)."""
    calls: int
    """Model calls the run made."""


Scorer = Callable[[Any, AgentOutcome], float]
"""``scorer(task, outcome) -> float`` (finite)."""


@dataclasses.dataclass(frozen=True, slots=True)
class AgentTask:
    """An external agent on one task; exactly one of ``agent`` / ``command``."""

    task: Any
    """The task handed to the agent (JSON-serializable for a command)."""
    scorer: Scorer
    """The reward of the run."""
    agent: AgentFn | None = None
    """An async callable ``agent(base_url, task)``."""
    command: Sequence[str] | None = None
    """A subprocess command (argv)."""
    limits: RunLimits = RunLimits()
    """Wall clock and token budget of the run."""

    def __post_init__(self) -> None:
        if (self.agent is None) == (self.command is None):
            raise ValueError("AgentTask needs exactly one of agent= and command=")
        if self.command is not None and (isinstance(self.command, str) or not self.command):
            raise ValueError(f"AgentTask.command must be a non-empty argv list, "
                             f"got {self.command!r}")
        if not callable(self.scorer):
            raise ValueError("AgentTask.scorer must be callable")


class AgentCrashed(RuntimeError):
    """The agent raised (or its process exited non-zero)."""


async def _subprocess(command: Sequence[str], base_url: str, task: Any) -> str:
    env = dict(os.environ, OPENAI_BASE_URL=base_url, OPENAI_API_KEY="xlong",
               XLONG_TASK=json.dumps(task))
    proc = await asyncio.create_subprocess_exec(*command, env=env,
                                                stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.PIPE)
    try:
        out, err = await proc.communicate()
    except asyncio.CancelledError:
        proc.kill()
        await proc.wait()
        raise
    if proc.returncode != 0:
        tail = err.decode("utf-8", "replace")[-800:]
        raise AgentCrashed(f"command exited with {proc.returncode}: {tail}")
    return out.decode("utf-8", "replace")


async def run_agent(endpoint: "Endpoint", spec: AgentTask, *, run_id: str,
                    group_id: str) -> RunResult:
    """One run of an external agent on ``endpoint`` (see module docstring); never raises for
    agent or scorer trouble. Raises ``Draining`` when the endpoint takes no new runs."""
    start = time.monotonic()
    live = endpoint.runs.open(group_id=group_id, run_id=run_id, limits=spec.limits)
    base_url = endpoint.base_url(run_id)
    status, reason, error, stdout = "finished", "answer", None, ""
    try:
        work = (spec.agent(base_url, spec.task) if spec.agent is not None
                else _subprocess(spec.command, base_url, spec.task))
        stdout = await bounded(work, spec.limits.wall_clock_s) or ""
        if live.over_budget is not None:
            status, reason = "timeout", _budget_reason(live.over_budget)
    except asyncio.TimeoutError:
        status, reason = "timeout", "wall_clock"
    except Exception as exc:  # noqa: BLE001 - the agent's crash is the run's outcome
        if live.over_budget is not None:
            status, reason = "timeout", _budget_reason(live.over_budget)
        else:
            status, reason, error = "failed", "agent_error", f"{type(exc).__name__}: {exc}"
    reward = 0.0
    if status != "failed":
        outcome = AgentOutcome(live.last_answer, stdout if isinstance(stdout, str) else "",
                               len(live.calls))
        try:
            reward = float(await asyncio.to_thread(spec.scorer, spec.task, outcome))
            if not math.isfinite(reward):
                raise ValueError(f"not finite: {reward}")
        except Exception as exc:  # noqa: BLE001 - recorded on the run
            status, reason, error, reward = "failed", "score_error", f"scorer: {exc!r}", 0.0
    try:
        run = endpoint.runs.end(run_id, reward=reward, status=status)
    except NoCallError as exc:
        run, reason = exc.run, "no_call"           # type: ignore[attr-defined]
        error = str(exc) if error is None else f"{error}; {exc}"
    info = RunInfo(reason, 0, 0, 0, 0, 0, time.monotonic() - start, error=error,
                   template_rewrites=live.rewrites)
    return RunResult(run, info)


def _budget_reason(over_budget: str) -> str:
    return "token_budget" if over_budget.startswith("token") else "wall_clock"


AGENT_TASKS: dict[str, Callable[[int], AgentTask]] = {}
"""Registered external-agent tasks: name → ``make(seed) -> AgentTask``."""


def register_agent_task(name: str, make: Callable[[int], AgentTask]) -> None:
    """Register an external-agent task under ``name`` (cells start it like a built-in task)."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"register_agent_task: name must be a non-empty string, got {name!r}")
    AGENT_TASKS[name] = make
