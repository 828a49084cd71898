"""The task interface: what a harness needs from an environment, as plain callables.

A *task* is a factory ``make(seed) -> TaskEnv``; a ``TaskEnv`` is one task instance for one run::

    env = make(seed)
    obs = env.reset()                       -> Observation(system, prompt)   (text; the harness
                                               tokenizes it with its ChatFormat)
    text = await env.call_tool(name, args)  -> the tool's output text (``args``: a dict that
                                               passed the tool's JSON schema; any length: the harness
                                               truncates); raise ToolError for a bad call (the
                                               agent sees the message), TaskFailure when the
                                               environment itself broke (the run fails)
    env.submit(answer)                      the main agent's final answer
    env.score()                             -> float, of the current state: final after submit,
                                               partial otherwise (timeouts are scored this way);
                                               may block (e.g. runs tests): called in a thread
    env.close()                             release resources (workspaces, processes)

``TaskEnv.tools`` declares the task's tools as OpenAI function schemas (``{"type": "function",
"function": {"name", "description", "parameters": <JSON schema>}}``, see
``rollout.tool_calls.function_schema``; ``subagent`` is the harness's own). The harness checks
each call's arguments against the schema (a failure is an error result the agent sees, the
tool is not called); a bare tool name stands for a tool taking any object. Envs are used
from one event loop, shared by every run: an ``async`` ``call_tool`` must not block it (and
should be cancellable; one that is not is abandoned at its time limit). A tool doing blocking
work may instead define ``call_tool`` as a plain function: the harness runs it in its own thread
under the same limit. ``score`` always runs in a thread, under ``score_timeout_s``.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Protocol


@dataclasses.dataclass(frozen=True, slots=True)
class Observation:
    """What a run starts from."""

    system: str
    """System prompt text."""
    prompt: str
    """The task statement (first user message)."""


class ToolError(Exception):
    """A tool call was wrong (unknown tool, bad arguments): shown to the agent, run goes on."""


class TaskFailure(Exception):
    """The environment broke (not the agent's fault): the run ends ``failed``."""


class UnknownTaskError(KeyError):
    """No task of that name is registered. The message lists the known names."""


class TaskEnv(Protocol):
    """One task instance for one run (see module docstring)."""

    tools: tuple[dict, ...]

    def reset(self) -> Observation:
        """Start (or restart) the instance; returns the observation."""

    async def call_tool(self, name: str, args: dict) -> str:
        """Run tool ``name`` with ``args``; returns its output text."""

    def submit(self, answer: str) -> None:
        """Record the main agent's final answer."""

    def score(self) -> float:
        """Reward of the current state, in [0, 1]."""

    def close(self) -> None:
        """Release resources."""


TaskFactory = Callable[[int], TaskEnv]
"""``make(seed) -> TaskEnv``: a task, deterministic per seed."""
