"""The time-compressed long-horizon job: what each run id of the scheduler starts, and the same
workload seen by the simulator.

Run ``r`` (group ``r // G``) is the ``long_horizon`` task with seed ``seed · 1_000_003 + r``
solved by the scripted oracle (``tasks.long_horizon.oracle_policy``) whose token logprobs come
from the cell's tiny model; its wall time is its tool time (heavy-tailed latencies, task time ×
``time_scale``: with ``1/3600`` one task hour is one wall second) plus model calls, cut at the
harness's ``wall_clock_s`` (a timed-out run keeps its partial score, so groups have non-zero
advantages). :func:`predicted_durations` replays each run's task seed to get the same tool
times without sleeping — the simulator's workload for the same job.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools

from ray_xlong.cells.runs import RunSpec, group_key, run_key
from ray_xlong.rollout.tasks.long_horizon import LongHorizonConfig, LongHorizonTask

TASK_NAME = "xlong_long_horizon"
"""Name the job's task is registered under in each runner."""


@dataclasses.dataclass(frozen=True, slots=True)
class LongHorizonJob:
    """The task every run of the job does."""

    task: LongHorizonConfig = LongHorizonConfig(num_steps=6, latency_median_s=1800.0,
                                                latency_sigma=0.8, time_scale=1 / 3600)
    """Task shape (default: 6 steps of median 0.5 task-hours → about 3 s a run)."""
    seed: int = 0
    """Workload seed."""
    delegate_every: int = 3
    """The oracle delegates every n-th step to a subagent."""
    model_logprobs: bool = True
    """Score the oracle's tokens with the cell's model; False keeps runners light (no model in
    the runner: behaviour logprobs are -1, fine for scheduling benchmarks, not for learning)."""

    def spec(self, run: int, *, runs_per_group: int) -> RunSpec:
        """What scheduler run id ``run`` starts."""
        return RunSpec(TASK_NAME, self.seed * 1_000_003 + run, run_key(run),
                       group_key(run // runs_per_group))

    def tasks(self) -> dict:
        """``{name: factory}`` to register in every runner."""
        return {TASK_NAME: functools.partial(LongHorizonTask, config=self.task)}

    def engine_factory(self, model_dir: str):
        """A picklable factory of the oracle :class:`ScriptedEngine` with model logprobs."""
        return functools.partial(oracle_engine, model_dir, self.task.num_steps,
                                 self.delegate_every, self.model_logprobs)


def oracle_engine(model_dir: str, num_steps: int, delegate_every: int,
                  model_logprobs: bool = True):
    """The scripted oracle engine (logprobs from the model in ``model_dir``, or none)."""
    import json
    import pathlib

    from ray_xlong.models import load_model
    from ray_xlong.rollout import ScriptedEngine, load_chat_format
    from ray_xlong.rollout.tasks.long_horizon import oracle_policy

    chat = load_chat_format(model_dir)
    policy = oracle_policy(chat, num_steps=num_steps, delegate_every=delegate_every)
    if not model_logprobs:
        vocab = json.loads((pathlib.Path(model_dir) / "config.json").read_text())["vocab_size"]
        return ScriptedEngine(policy, vocab_size=vocab)
    model = load_model(model_dir)
    return ScriptedEngine(policy, vocab_size=model.config.vocab_size, model=model)


def tool_seconds(job: LongHorizonJob, run: int) -> float:
    """Wall seconds of tool time of ``run`` (its task seed replayed, nothing slept)."""
    cfg = dataclasses.replace(job.task, time_scale=1e-12)
    env = LongHorizonTask(job.seed * 1_000_003 + run, config=cfg)
    env.reset()

    async def work() -> None:
        for step in range(1, cfg.num_steps + 1):
            await env.call_tool("work", {"step": step})
    asyncio.run(work())
    return env.tool_seconds * job.task.time_scale


def predicted_durations(job: LongHorizonJob, *, runs: int, call_s: float,
                        timeout_s: float) -> list[float]:
    """Per run: tool time + ``call_s`` per model call, capped at ``timeout_s`` (seconds)."""
    n = job.task.num_steps
    subs = n // job.delegate_every if job.delegate_every else 0
    calls = n + 1 + 2 * subs  # a call per step + the answer; a delegated step adds two
    return [min(tool_seconds(job, r) + calls * call_s, timeout_s) for r in range(runs)]
