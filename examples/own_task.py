"""Your own task, your own data: train on a task defined in this script, by name and by factory.

    python examples/own_task.py                    # ~3 min on 2 CPU cores (tiny model)
    python examples/own_task.py --json out/own_task.json

1. ``Capital`` is a task written here (the ``TaskEnv`` interface: ``reset``, ``call_tool``,
   ``submit``, ``score``, ``close``), registered under a name in this process only, and trained
   for 2 steps with ``.xlong(task="capital")``: the name's factory travels to every cell.
2. The same environment over rows of a JSONL file, as a ``DatasetTask`` (one row = one
   instance; shuffled per epoch from the seed; position saved in checkpoints) split into train
   and held-out rows, trained for 2 steps with ``.xlong(task=<the factory>)`` and evaluated on
   the held-out rows by RLlib's own ``.evaluation(evaluation_interval=2, ...)``: the second
   result carries ``evaluation/env_runners/pass_at_1`` and ``pass_at_2``.

The policy is a tiny random model (plumbing, not learning), so it runs the tiny lookup
recipe's budgets (``lookup_recipe()``); a real policy keeps the defaults (docs/own-task.md).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import tempfile

from ray_xlong.rollout.tasks import Observation, ToolError
from ray_xlong.rollout.tool_calls import function_schema

CAPITALS = {"France": "Paris", "Japan": "Tokyo", "Peru": "Lima", "Kenya": "Nairobi",
            "Chile": "Santiago", "Egypt": "Cairo", "Spain": "Madrid", "Ghana": "Accra"}


class Capital:
    """Name a country's capital; a ``lookup`` tool answers (reward 1 for the right city)."""

    tools = (function_schema("lookup", "The capital of a country.",
                             {"country": {"type": "string"}}),)

    def __init__(self, row: dict) -> None:
        self.country, self.city = row["country"], row["city"]
        self.answer: str | None = None

    @classmethod
    def from_seed(cls, seed: int) -> "Capital":
        """``make(seed)``: the task by name draws its country from the seed."""
        country = sorted(CAPITALS)[seed % len(CAPITALS)]
        return cls({"country": country, "city": CAPITALS[country]})

    def reset(self) -> Observation:
        self.answer = None
        return Observation("Use the lookup tool, then answer.",
                           f"What is the capital of {self.country}?")

    async def call_tool(self, name: str, args: dict) -> str:
        if name != "lookup":
            raise ToolError(f"unknown tool {name!r}; tools: lookup")
        return CAPITALS.get(str(args.get("country")), "unknown")

    def submit(self, answer: str) -> None:
        self.answer = answer

    def score(self) -> float:
        return float(self.answer is not None and self.answer.strip() == self.city)

    def close(self) -> None:
        pass


def config(model_dir: str):
    """2 elastic cells, 2 groups × 4 runs a step, the tiny recipe's budgets."""
    from ray_xlong.rllib.algorithm_config import XLongConfig

    return (XLongConfig().lookup_recipe().debugging(seed=0)
            .training(train_batch_size_per_learner=8)
            .xlong(mode="elastic", cells=2, runs_per_group=4, slots_per_cell=8,
                   model_dir=model_dir, placement_strategy="PACK"))


def train(cfg, steps: int, label: str) -> list[dict]:
    algo = cfg.build_algo()
    try:
        results = [algo.train() for _ in range(steps)]
    finally:
        algo.stop()
    for r in results:
        line = (f"{label} step {r['training_iteration']}: reward "
                f"{r['env_runners']['episode_return_mean']:.2f}, runs "
                f"{r['env_runners']['num_episodes']}")
        if "evaluation" in r:
            ev = r["evaluation"]["env_runners"]
            line += (f" | held-out: return {ev['episode_return_mean']:.2f}, pass@1 "
                     f"{ev['pass_at_1']:.2f}, pass@2 {ev['pass_at_2']:.2f}")
        print(line, flush=True)
    return results


def write_rows(path: pathlib.Path) -> None:
    path.write_text("".join(json.dumps({"country": c, "city": t}) + "\n"
                            for c, t in CAPITALS.items()))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--json", default=None, help="write the rewards and evaluation here")
    args = p.parse_args(argv)
    from ray_xlong.models import build_tiny_model_dir
    from ray_xlong.rollout.tasks import DatasetTask, register_task
    from ray_xlong.jobs.train import ensure_ray

    work = pathlib.Path(tempfile.mkdtemp(prefix="rx-own-task-"))
    model_dir = str(build_tiny_model_dir(work / "policy", seed=0))
    ensure_ray(cpus=2, gpus=2)

    register_task("capital", Capital.from_seed)          # by name: this process only
    by_name = train(config(model_dir).xlong(task="capital"), args.steps, "by name")

    write_rows(work / "capitals.jsonl")                  # by factory: a dataset of instances
    data = DatasetTask.from_jsonl(work / "capitals.jsonl", env=Capital, seed=0,
                                  required=("country", "city"))
    rows, held_out = data.split(eval_rows=2)
    by_factory = train(config(model_dir).xlong(task=rows, eval_task=held_out, eval_samples=2)
                       .evaluation(evaluation_interval=2, evaluation_duration=2),
                       args.steps, "by factory")
    if args.json:
        out = {"by_name": [r["env_runners"]["episode_return_mean"] for r in by_name],
               "by_factory": [r["env_runners"]["episode_return_mean"] for r in by_factory],
               "evaluation": [r["evaluation"]["env_runners"] for r in by_factory
                              if "evaluation" in r]}
        pathlib.Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        pathlib.Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
