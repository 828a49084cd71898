"""A long-horizon synthetic task: many steps whose tools take heavy-tailed, time-scaled time.

The agent must finish ``num_steps`` steps in order with ``work <k>``. Each call sleeps a
log-normal latency (``latency_median_s × exp(sigma · z)``, times ``time_scale``: hours of tool
time become seconds) and returns a log of heavy-tailed length, so contexts grow past the
harness's compaction budget; the ``subagent`` tool (the harness's) can do a step in a child.

Score: fraction of steps done (partial state; a timed-out run keeps its progress).
:func:`oracle_policy` is a scripted policy (ids → ids) that solves it, summarizes when asked
and delegates every ``delegate_every``-th step to a subagent — for benchmarks and tests.
"""

from __future__ import annotations

import asyncio
import dataclasses
import re

import numpy as np

from ray_xlong.rollout.chat import ToolCall
from ray_xlong.rollout.tasks.base import Observation, ToolError
from ray_xlong.rollout.tool_calls import function_schema

SYSTEM = "Do every step in order with work, delegate with subagent, answer done."
_STEP = re.compile(r"step (\d+) done")


@dataclasses.dataclass(frozen=True, slots=True)
class LongHorizonConfig:
    """Shape of the task."""

    num_steps: int = 8
    """Steps to finish."""
    latency_median_s: float = 60.0
    """Median tool latency in task time (seconds)."""
    latency_sigma: float = 1.5
    """Log-normal sigma of latency (heavier tail when larger)."""
    time_scale: float = 1e-4
    """Wall seconds per task second."""
    log_words_mean: float = 12.0
    """Mean length of a work log (log-normal, same sigma), in words."""
    run_sigma: float = 0.0
    """Log-normal sigma of a per-run pace that multiplies every latency of the run (with
    ``latency_sigma`` 0 a run's tool time is exactly log-normal: median ``num_steps`` ×
    ``latency_median_s``, shape ``run_sigma``, as in ``ray_xlong.sim``'s workload model)."""

    def __post_init__(self) -> None:
        for name in ("num_steps", "latency_median_s", "time_scale", "log_words_mean"):
            if not getattr(self, name) > 0:
                raise ValueError(f"LongHorizonConfig.{name} must be > 0, "
                                 f"got {getattr(self, name)!r}")
        for name in ("latency_sigma", "run_sigma"):
            if getattr(self, name) < 0:
                raise ValueError(f"LongHorizonConfig.{name} must be >= 0, "
                                 f"got {getattr(self, name)!r}")


class LongHorizonTask:
    """One instance (see module docstring)."""

    tools = (function_schema("work", "Do step k (in order, from 1).",
                             {"step": {"type": "integer", "minimum": 1}}),)

    def __init__(self, seed: int, *, config: LongHorizonConfig = LongHorizonConfig()) -> None:
        self.config = config
        self.rng = np.random.default_rng(seed)
        self.done = 0
        self.answer: str | None = None
        self.tool_seconds = 0.0
        self.pace = float(np.exp(config.run_sigma * self.rng.normal())) if config.run_sigma else 1.0

    def reset(self) -> Observation:
        self.done, self.answer = 0, None
        return Observation(SYSTEM, f"Finish {self.config.num_steps} steps.")

    async def call_tool(self, name: str, args: dict) -> str:
        if name != "work":
            raise ToolError(f"unknown tool {name!r}; tools: work, subagent")
        try:
            step = int(args["step"])
        except (KeyError, TypeError, ValueError):
            raise ToolError(f"work takes a step number, got {args!r}") from None
        if step != self.done + 1:
            raise ToolError(f"step {step} is out of order; next is {self.done + 1}")
        cfg = self.config
        latency = self.pace * cfg.latency_median_s * float(
            np.exp(cfg.latency_sigma * self.rng.normal()))
        self.tool_seconds += latency
        await asyncio.sleep(latency * cfg.time_scale)
        self.done = step
        words = max(1, int(cfg.log_words_mean * np.exp(cfg.latency_sigma * self.rng.normal()
                                                       - cfg.latency_sigma ** 2 / 2)))
        return f"step {step} done " + " ".join(["ok"] * words)

    def submit(self, answer: str) -> None:
        self.answer = answer

    def score(self) -> float:
        return self.done / self.config.num_steps

    def close(self) -> None:
        pass


def oracle_policy(chat, *, num_steps: int, delegate_every: int = 3):
    """A scripted policy ``(input_ids) -> output_ids`` that solves the task.

    Main agent: ``work k`` for the next step k (from the last ``step k done`` in its context,
    summary included), ``subagent do step k`` every ``delegate_every``-th step, ``answer
    done`` at the end. Subagent: ``work k`` once, then ``answer step k done``. Summary call:
    ``step k done`` for the last step seen.
    """
    from ray_xlong.rollout.template_format import SUMMARY_REQUEST

    def call(name: str, **args) -> np.ndarray:
        return chat.turn_ids(calls=[ToolCall(name, args)])

    def policy(input_ids: np.ndarray) -> np.ndarray:
        text = chat.decode(input_ids)
        done = max((int(k) for k in _STEP.findall(text)), default=0)
        if int(input_ids[-1]) == getattr(chat, "summarize", -1) \
                or SUMMARY_REQUEST in text[-200:]:
            return chat.turn_ids(text=f"step {done} done") if not hasattr(chat, "summarize") \
                else np.concatenate([chat.encode(f"step {done} done"), [chat.end]])
        sub = re.search(r"Subtask: do step (\d+)", text)
        if sub:
            k = int(sub.group(1))
            return chat.turn_ids(text=f"step {k} done") if done >= k else call("work", step=k)
        if done >= num_steps:
            return chat.turn_ids(text="done")
        if delegate_every and (done + 1) % delegate_every == 0:
            return call("subagent", task=f"do step {done + 1}")
        return call("work", step=done + 1)
    return policy
