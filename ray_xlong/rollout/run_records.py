"""The harness's records: its per-run budgets (:class:`HarnessConfig`) and what it reports of
an ended run (:class:`RunResult` = the token-exact :class:`~ray_xlong.trajectory.AgentRun` + its
:class:`RunInfo` counts). The harness (``harness.py``) fills them; the runner, the spool, the
endpoint's external agents and the agent statistics (``run_stats.py``) read them.
"""

from __future__ import annotations

import dataclasses
import math

from ray_xlong.checks import check_int
from ray_xlong.trajectory import AgentRun


@dataclasses.dataclass(frozen=True, slots=True)
class HarnessConfig:
    """Budgets and limits of one run; validated at construction."""

    max_new_tokens: int = 64
    """Most tokens per model call."""
    temperature: float = 1.0
    """Sampling temperature (0 = greedy)."""
    context_capacity: int = 4096
    """Tokens an agent's context buffer holds."""
    compaction_budget: int = 2048
    """Compact when a context passes this many tokens."""
    summary_max_tokens: int = 64
    """Most tokens of a summary."""
    max_run_tokens: int = 8192
    """Generated-token budget of a run (all agents); passing it is a timeout."""
    wall_clock_s: float = 600.0
    """Wall-clock budget of a run; passing it is a timeout."""
    max_calls: int = 64
    """Main-agent model calls (retries and summaries included) before a timeout."""
    subagent_max_calls: int = 8
    """Model calls of one subagent."""
    max_subagent_depth: int = 1
    """Nesting of subagents (0 disables the subagent tool)."""
    max_retries: int = 2
    """Consecutive malformed outputs retried from the same context."""
    max_engine_retries: int = 2
    """Engine errors retried per call before the run fails."""
    tool_timeout_s: float = 30.0
    """Time limit of one tool call (finite)."""
    max_tool_output_tokens: int = 256
    """Tool output kept, in tokens."""
    score_timeout_s: float = 300.0
    """Time limit of scoring a run (``env.score``, finite); passing it fails the run."""

    def __post_init__(self) -> None:
        for name in ("max_new_tokens", "context_capacity", "compaction_budget",
                     "summary_max_tokens", "max_run_tokens", "max_calls", "subagent_max_calls",
                     "max_tool_output_tokens"):
            check_int("HarnessConfig", name, getattr(self, name), minimum=1)
        for name in ("max_subagent_depth", "max_retries", "max_engine_retries"):
            check_int("HarnessConfig", name, getattr(self, name), minimum=0)
        for name in ("wall_clock_s", "tool_timeout_s", "score_timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not 0 < value < math.inf:
                raise ValueError(f"HarnessConfig.{name} must be a finite number > 0 (an "
                                 f"unbounded wait could hang a run), got {value!r}")
        if not self.temperature >= 0:
            raise ValueError(f"HarnessConfig.temperature must be >= 0, got {self.temperature!r}")
        if self.compaction_budget + self.max_new_tokens + self.max_tool_output_tokens + 8 \
                > self.context_capacity:
            raise ValueError("HarnessConfig.compaction_budget + max_new_tokens + "
                             "max_tool_output_tokens + 8 must fit in context_capacity")


@dataclasses.dataclass(frozen=True, slots=True)
class RunInfo:
    """What happened in a run besides its calls."""

    stop_reason: str
    """``answer`` | ``wall_clock`` | ``token_budget`` | ``call_budget`` | ``context_full`` |
    ``engine_error`` | ``task_failure`` | ``score_error`` | ``chat_format`` (the chat template
    refused to render the conversation)."""
    retries: int
    """Malformed outputs retried."""
    engine_retries: int
    """Engine errors retried."""
    compactions: int
    """Summary calls."""
    subagents: int
    """Subagents started."""
    tool_errors: int
    """Tool calls that raised, timed out or named an unknown tool."""
    elapsed_s: float
    """Wall-clock seconds of the run."""
    error: str | None = None
    """The error that failed the run, if any."""
    tool_truncations: int = 0
    """Tool results cut to ``max_tool_output_tokens``."""
    template_rewrites: int = 0
    """Deltas taken while the chat template rewrote earlier turns (the context kept them)."""
    turns: int = 0
    """Main-agent outputs acted on (a tool call or the answer; retried outputs not counted)."""
    tool_calls: int = 0
    """Tool calls issued (subagent starts included), whether they succeeded or not."""
    malformed: int = 0
    """Model outputs that did not parse (retried, or answered with an error result)."""


@dataclasses.dataclass(frozen=True, slots=True)
class RunResult:
    """An ended run and its info."""

    run: AgentRun
    """The token-exact, scored run."""
    info: RunInfo
    """Counts and why it stopped."""
