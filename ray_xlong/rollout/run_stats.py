"""Agent statistics: one small record per ended run, and their summary over a step's runs.

```
RunResult (AgentRun + RunInfo) ─► run_stats() ─► RunStats        one per run, where it ended
[RunStats of the runs a step trained] ─► agent_step_stats() ─► AgentStepStats ─► as_metrics()
```

The counters come from the harness's counting points (``RunInfo``: turns, tool calls, tool
errors, malformed outputs, retries, compactions, subagents, stop reason, wall time); model calls
and generated tokens from the run's records. Stop reasons are ``finished`` or
``<status>_<reason>`` (``timeout_wall_clock``, ``failed_engine_error``, …): every key of
:data:`STOP_KEYS` is always present in the metrics (0 when no run stopped that way), so the
columns of a tracker do not change from step to step.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from ray_xlong.rollout.run_records import RunResult

TIMEOUT_REASONS = ("wall_clock", "token_budget", "call_budget", "context_full")
"""How a run times out (``RunInfo.stop_reason`` of a ``timeout``)."""
FAILED_REASONS = ("engine_error", "task_failure", "score_error")
"""How a run fails (``RunInfo.stop_reason`` of a ``failed`` run)."""
STOP_KEYS = ("finished", *(f"timeout_{r}" for r in TIMEOUT_REASONS),
             *(f"failed_{r}" for r in FAILED_REASONS))
"""Stop-reason keys of :meth:`AgentStepStats.as_metrics` (``stop_<key>``: runs)."""
COUNTERS = ("turns", "model_calls", "tool_calls", "tool_errors", "malformed", "retries",
            "compactions", "subagents", "template_rewrites", "tokens")
"""Per-run counters summed and averaged per step (``<name>_mean`` / ``<name>_sum``)."""


@dataclasses.dataclass(frozen=True, slots=True)
class RunStats:
    """What one run did (counts are over all its agents)."""

    stop: str
    """``finished`` | ``timeout_<reason>`` | ``failed_<reason>`` (a key of :data:`STOP_KEYS`,
    or ``<status>_<reason>`` for a reason this version does not know)."""
    turns: int
    """Main-agent steps (model outputs the main agent acted on: a tool call or its answer)."""
    model_calls: int
    """Model calls of every kind (main, summary, subagent; retried outputs included)."""
    tool_calls: int
    """Tool calls issued (subagent starts included), whether they succeeded or not."""
    tool_errors: int
    """Tool calls that raised, timed out or named an unknown tool."""
    malformed: int
    """Model outputs that did not parse (retried or answered with an error)."""
    retries: int
    """Malformed outputs retried from the same context."""
    compactions: int
    """Summary calls (the context was replaced by a summary)."""
    subagents: int
    """Subagents started."""
    template_rewrites: int
    """Environment deltas taken while the chat template rewrote earlier turns (the context
    kept what the model saw; the prefix tree branches where a later render differs)."""
    tokens: int
    """Tokens the model generated in the run."""
    wall_s: float
    """Wall-clock seconds of the run."""


def run_stats(result: RunResult) -> RunStats:
    """The :class:`RunStats` of an ended run."""
    run, info = result.run, result.info
    stop = "finished" if run.status == "finished" else f"{run.status}_{info.stop_reason}"
    return RunStats(stop=stop, turns=info.turns, model_calls=len(run.calls),
                    tool_calls=info.tool_calls, tool_errors=info.tool_errors,
                    malformed=info.malformed, retries=info.retries,
                    compactions=info.compactions, subagents=info.subagents,
                    template_rewrites=info.template_rewrites, tokens=run.num_tokens, wall_s=float(info.elapsed_s))


@dataclasses.dataclass(frozen=True, slots=True)
class AgentStepStats:
    """The runs one step trained, summarised."""

    runs: int
    """Runs summarised."""
    sums: dict[str, int]
    """Per counter of :data:`COUNTERS`: the sum over the runs."""
    stops: dict[str, int]
    """Per stop key: runs that stopped that way (every key of :data:`STOP_KEYS`)."""
    wall_s_p50: float
    """Median run wall time (0.0 when no runs)."""
    wall_s_p95: float
    """95th percentile of the run wall time (0.0 when no runs)."""

    def as_metrics(self) -> dict[str, float]:
        """Flat metrics: ``runs``, ``<counter>_sum`` / ``<counter>_mean``, ``stop_<key>``,
        ``wall_s_p50`` / ``wall_s_p95``, ``tokens_per_run`` (all finite)."""
        out: dict[str, float] = {"runs": float(self.runs)}
        for name in COUNTERS:
            total = self.sums[name]
            out[f"{name}_sum"] = float(total)
            out[f"{name}_mean"] = total / self.runs if self.runs else 0.0
        out["tokens_per_run"] = out.pop("tokens_mean")
        out.update({f"stop_{key}": float(n) for key, n in self.stops.items()})
        out["wall_s_p50"], out["wall_s_p95"] = self.wall_s_p50, self.wall_s_p95
        return out


def agent_step_stats(runs: Sequence[RunStats]) -> AgentStepStats:
    """Summarise the runs of one step (any order; an empty step gives zeros)."""
    sums = {name: int(sum(getattr(r, name) for r in runs)) for name in COUNTERS}
    stops = dict.fromkeys(STOP_KEYS, 0)
    for r in runs:
        stops[r.stop] = stops.get(r.stop, 0) + 1
    walls = np.array([r.wall_s for r in runs], dtype=np.float64)
    p50, p95 = (np.percentile(walls, [50, 95]) if walls.size else (0.0, 0.0))
    return AgentStepStats(runs=len(runs), sums=sums, stops=stops, wall_s_p50=float(p50),
                          wall_s_p95=float(p95))
