"""Bring your own agent: an agent written only against the ``openai`` package, trained with RL on
elastic cells.

The agent (:func:`agent`) is a plain function-calling loop: it knows nothing of ray_xlong. It
gets an OpenAI base URL and a task, asks the endpoint which model it serves, owns its tools
(``lookup`` in a hidden table, ``add`` for sums it does not need here) and answers with text.
ray_xlong runs it as the job's task on the real cell runtime::

    embedded local Ray, 2 elastic cells (each: a rollout runner with an HF | vLLM engine and
    its OpenAI-compatible endpoint, and a Learner), tiny ChatML model warm-started on the tool
    format (look up *some* key, answer its value)
    each run: the driver starts it on a rollout cell ─► the runner opens it on that cell's
        endpoint and hands the agent that cell's base URL ─► the agent's calls are recorded
        token-exactly ─► the run ends on the cell, is scored (:func:`scorer`) and processed
        there ─► digests to the driver ─► a training cell trains it (PPO/TIS, count-once tree)
    cells switch between rollout and training on their own (elastic; staleness bound 0)

Reward: 1 for the right value, 0.2 for looking the right key up but answering wrong. RL has to
learn to copy the asked key into the call (see ``rollout/tasks/lookup.py``).

    python examples/openai_agent.py [--steps 30] [--groups 4] [--runs-per-group 8] [--seed 1]
                                    [--engine hf|vllm] [--json curve.json]

Measured: see the README's "Bring your own agent" section (first 3 steps vs last 3 / last 5).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import ssl
import sys
import time

import numpy as np
import openai

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

SYSTEM = "Use the lookup tool, then answer."
TOOLS = [
    {"type": "function", "function": {
        "name": "lookup", "description": "The value of a key in the table.",
        "parameters": {"type": "object", "properties": {
            "key": {"type": "integer", "minimum": 0, "maximum": 9}},
            "required": ["key"], "additionalProperties": False}}},
]
AGENT_NAME = "openai-lookup"
"""The name the agent is registered under in every runner (the job's task)."""


# -- the agent: only the openai package -----------------------------------------------------
_TLS: list[ssl.SSLContext] = []
"""The process's one TLS context (built on first use)."""


def tls_context() -> ssl.SSLContext:
    """The process's one TLS context: building one loads the CA bundle, ~25-50 ms of CPU
    (measured), which on a tiny model costs more than an agent's calls."""
    if not _TLS:
        _TLS.append(ssl.create_default_context())
    return _TLS[0]


def make_client(base_url: str) -> openai.AsyncOpenAI:
    """One client per agent, on the process's one TLS context (:func:`tls_context`)."""
    return openai.AsyncOpenAI(base_url=base_url, api_key="none", max_retries=0,
                              http_client=openai.DefaultAsyncHttpxClient(verify=tls_context()))


async def agent(base_url: str, task: dict) -> None:
    """A function-calling loop: call tools until the model answers (at most 4 turns)."""
    client = make_client(base_url)
    model = (await client.models.list()).data[0].id
    messages = [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": f"What is the value of key {task['key']}?"}]
    try:
        for _ in range(4):
            r = await client.chat.completions.create(model=model, messages=messages,
                                                     tools=TOOLS, max_tokens=24,
                                                     temperature=1.0)
            msg = r.choices[0].message
            messages.append(msg.model_dump(exclude_none=True))
            if not msg.tool_calls:
                task["answer"] = (msg.content or "").strip()
                return
            for call in msg.tool_calls:
                try:
                    key = str(json.loads(call.function.arguments)["key"])
                    result = task["table"].get(key, f"error: no key {key}")
                except (ValueError, KeyError, TypeError):
                    result = "error: lookup takes {\"key\": <int>}"
                task["looked_up"].append(key if "error" not in result else None)
                messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    finally:
        await client.close()


def scorer(task: dict, outcome) -> float:
    """1 for the right value; 0.2 for looking the right key up; else 0."""
    if task.get("answer") == task["table"][task["key"]]:
        return 1.0
    return 0.2 if task["key"] in task["looked_up"] else 0.0


def make_task(seed: int) -> dict:
    """The task handed to :func:`agent`: the lookup instance of ``seed`` (its hidden table)."""
    from ray_xlong.rollout.tasks.lookup import LookupTask

    t = LookupTask(seed)
    return {"key": t.key, "table": dict(t.table), "looked_up": []}


def make_agent_task(seed: int):
    """The job's task: ``make(seed) -> AgentTask`` (this agent on :func:`make_task`)."""
    from ray_xlong.serving.agents import AgentTask

    return AgentTask(make_task(seed), scorer, agent=agent)


# -- training (ray_xlong) -------------------------------------------------------------------
def train(*, steps: int, seed: int, groups: int, runs_per_group: int, engine: str,
          workdir: str, cells: int = 2, warm=None, on_step=None) -> dict:
    """Elastic RL of :func:`agent` on ``cells`` local cells; returns the reward curve and
    timings."""
    from ray_xlong.cells.task_job import warm_started_model_dir
    from ray_xlong.rllib.algorithm_config import XLongConfig
    from ray_xlong.rollout.tasks.lookup import LookupTask
    from ray_xlong.sim.metrics import role_switches
    from ray_xlong.jobs.train import ensure_ray

    assert list(LookupTask(0).tools) == TOOLS, "the agent's tools are the warm start's"
    t0 = time.perf_counter()
    model_dir = warm_started_model_dir(workdir, seed=seed, warm=warm, style="chatml_tiny")
    t1 = time.perf_counter()
    ensure_ray(cpus=max(2, cells), gpus=cells)
    config = (XLongConfig().debugging(seed=seed).lookup_recipe()
              .training(train_batch_size_per_learner=groups * runs_per_group)
              .xlong(mode="elastic", cells=cells, runs_per_group=runs_per_group, engine=engine,
                     model_dir=model_dir, staleness_bound=0, placement_strategy="PACK",
                     task=AGENT_NAME, agent_task=make_agent_task))
    algo = config.build_algo()
    t2 = time.perf_counter()
    try:
        for _ in range(steps):
            algo.train()
            if on_step is not None:
                on_step(algo.reports[-1])
        events = algo.events()
    finally:
        algo.stop()
    rewards = [r.reward_mean for r in algo.reports]
    return {"seed": seed, "engine": engine, "rewards": rewards,
            "runs": sum(r.runs for r in algo.reports),
            "role_switches": sum(role_switches(events).values()),
            "warm_start_s": t1 - t0, "startup_s": t2 - t1, "train_s": time.perf_counter() - t2}


def main(argv=None) -> int:
    from ray_xlong.cli_args import int_at_least

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int_at_least(1), default=30)
    parser.add_argument("--groups", type=int_at_least(1), default=4)
    parser.add_argument("--runs-per-group", type=int_at_least(2), default=8)
    parser.add_argument("--seed", type=int_at_least(0), default=1)
    parser.add_argument("--engine", default="hf", choices=["hf", "vllm"])
    parser.add_argument("--workdir", default=".cache/ray_xlong", help="warm-start cache")
    parser.add_argument("--json", default=None, help="write the reward curve here")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny budget (CI): 2 steps of 2 groups x 2 runs, a short warm start")
    args = parser.parse_args(argv)
    warm = None
    if args.smoke:
        from ray_xlong.rollout.lookup_recipe import WarmStartConfig

        args.steps, args.groups, args.runs_per_group = 2, 2, 2
        warm = WarmStartConfig(clean_steps=5, noisy_steps=2, min_accuracy=0.0)  # plumbing only

    def on_step(report) -> None:
        print(f"step {report.version:3d}  reward {report.reward_mean:.3f}  runs {report.runs}  "
              f"tokens {report.tokens_trained}  {report.step_s:.1f} s", flush=True)

    out = train(steps=args.steps, seed=args.seed, groups=args.groups,
                runs_per_group=args.runs_per_group, engine=args.engine, workdir=args.workdir,
                warm=warm, on_step=on_step)
    r = np.asarray(out["rewards"])
    k = min(3, len(r))
    out["reward_first3"], out["reward_last3"] = float(r[:k].mean()), float(r[-k:].mean())
    out["reward_last5"] = float(r[-min(5, len(r)):].mean())
    print(f"\nelastic on {args.engine}, seed {args.seed}: reward first 3 steps "
          f"{out['reward_first3']:.3f} -> last 3 {out['reward_last3']:.3f} (rise "
          f"{out['reward_last3'] - out['reward_first3']:+.3f}; last 5 "
          f"{out['reward_last5']:.3f}); {out['runs']} runs, {out['role_switches']} role "
          f"switches; warm start {out['warm_start_s']:.0f} s, cells up {out['startup_s']:.0f} s, "
          f"training {out['train_s']:.0f} s")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
