"""Bring your own agent: an agent written only against the ``openai`` package, trained with RL.

The agent (:func:`agent`) is a plain function-calling loop: it knows nothing of ray_xlong. It
gets an OpenAI base URL and a task, owns its tools (``lookup`` in a hidden table, ``add`` for
sums it does not need here), and answers with text. ray_xlong gives each run a base URL on the
cell's endpoint, records every call token-exactly, scores the run and trains on it::

    tiny ChatML model (chatml_tiny), warm-started on the tool format (look up *some* key,
    answer its value)
    for step in 1..N:
        G tasks × R runs:  run_agent(endpoint, AgentTask(task, scorer, agent=agent))   (HTTP)
        recorded runs ──► TrajectoryProcessor (one trajectory per run, count-once)
        ──► PPO/TIS step on the learner ──► new weights to the endpoint's engine (version += 1)

Reward: 1 for the right value, 0.2 for looking the right key up but answering wrong. RL has to
learn to copy the asked key into the call (see ``rollout/tasks/lookup.py``).

    python examples/openai_agent.py [--steps 30] [--groups 8] [--runs-per-group 8] [--seed 1]

Measured (``--steps 30 --groups 4 --runs-per-group 8 --seed 1``, 2 shared cores): mean reward
of the first 3 steps 0.287 → last 3 steps 0.731 (+0.444), one trajectory per run, 0 failed.

This loop is local (one process: learner, HF engine, endpoint); on cells, register the task
with ``ray_xlong.serving.agents.register_agent_task`` and the runners start it like a built-in
task through their own endpoint.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import pathlib
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


# -- the agent: only the openai package -----------------------------------------------------
async def agent(base_url: str, task: dict) -> None:
    """A function-calling loop: call tools until the model answers (at most 4 turns)."""
    client = openai.AsyncOpenAI(base_url=base_url, api_key="none", max_retries=0)
    messages = [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": f"What is the value of key {task['key']}?"}]
    for _ in range(4):
        r = await client.chat.completions.create(model=task["model"], messages=messages,
                                                 tools=TOOLS, max_tokens=24, temperature=1.0)
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
    await client.close()


def scorer(task: dict, outcome) -> float:
    """1 for the right value; 0.2 for looking the right key up; else 0."""
    if task.get("answer") == task["table"][task["key"]]:
        return 1.0
    return 0.2 if task["key"] in task["looked_up"] else 0.0


# -- training (ray_xlong) -------------------------------------------------------------------
def make_task(seed: int, model: str) -> dict:
    from ray_xlong.rollout.tasks.lookup import LookupTask

    t = LookupTask(seed)
    return {"key": t.key, "table": dict(t.table), "model": model, "looked_up": []}


def build(seed: int, workdir: pathlib.Path):
    """The warm-started tiny ChatML policy (``task_job.warm_started_model_dir``, cached), the
    learner, and a threaded endpoint on an HF engine of the same weights."""
    import torch

    from ray_xlong.models import load_model
    from ray_xlong.cells.task_job import warm_started_model_dir
    from ray_xlong.rollout.tasks.lookup import LookupTask
    from ray_xlong.serving.server import ThreadedEndpoint, build_endpoint

    assert list(LookupTask(0).tools) == TOOLS, "the agent's tools are the warm start's"
    torch.manual_seed(seed)
    model_dir = pathlib.Path(warm_started_model_dir(workdir, seed=seed, style="chatml_tiny"))
    learner = load_model(model_dir)
    hosted = ThreadedEndpoint(lambda: build_endpoint(model_dir, engine="hf", seed=seed,
                                                     max_batch_size=256))
    return model_dir, learner, hosted


async def rollout_step(endpoint, *, step: int, seeds, runs_per_group: int, model: str):
    from ray_xlong.serving.agents import AgentTask, run_agent

    jobs = []
    for g, seed in enumerate(seeds):
        for r in range(runs_per_group):
            spec = AgentTask(make_task(int(seed), model), scorer, agent=agent)
            jobs.append(run_agent(endpoint, spec, run_id=f"s{step}g{g}r{r}",
                                  group_id=f"s{step}g{g}"))
    return [res.run for res in await asyncio.gather(*jobs)]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--runs-per-group", type=int, default=8)
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--workdir", default=".cache/ray_xlong", help="warm-start cache")
    parser.add_argument("--json", default=None, help="write the reward curve here")
    args = parser.parse_args(argv)
    import torch

    from ray_xlong.tools.local_rl import push_weights, train_step
    from ray_xlong.trajectory import ProcessorConfig, TrajectoryProcessor
    from ray_xlong.trajectory.packing import micro_batches

    t0 = time.perf_counter()
    model_dir, learner, hosted = build(args.seed, pathlib.Path(args.workdir))
    name = model_dir.name
    opt = torch.optim.AdamW(learner.parameters(), lr=args.lr, weight_decay=0.0)
    processor = TrajectoryProcessor(ProcessorConfig(pack="per_trajectory"))
    curve = []
    print(f"warm start + endpoint {hosted.url}: {time.perf_counter() - t0:.0f} s", flush=True)
    try:
        for step in range(1, args.steps + 1):
            seeds = np.random.default_rng([args.seed, step]).integers(0, 2**31, args.groups)
            runs = hosted.call(rollout_step(hosted.endpoint, step=step, seeds=seeds,
                                            runs_per_group=args.runs_per_group, model=name),
                               timeout=900)
            reward = float(np.mean([r.reward for r in runs]))
            trainable = [r for r in runs if r.status != "failed"]
            batch = processor.process(trainable)
            stats = train_step(learner, opt, micro_batches(batch.packed, max_tokens=8192))
            hosted.call(push_weights(learner, hosted.endpoint.engine, version=step))
            per_run = len(batch.trajectories) / max(len(trainable), 1)
            curve.append(reward)
            print(f"step {step:3d}  reward {reward:.3f}  trajectories/run {per_run:.2f}  "
                  f"failed {len(runs) - len(trainable)}  loss {stats.loss:+.4f}", flush=True)
    finally:
        hosted.close()
    first, last = np.mean(curve[:3]), np.mean(curve[-3:])
    print(f"\nreward first 3 steps {first:.3f} -> last 3 steps {last:.3f} "
          f"(rise {last - first:+.3f}); {time.perf_counter() - t0:.0f} s")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps({"rewards": curve, "seed": args.seed}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
