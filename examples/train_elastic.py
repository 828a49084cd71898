"""The main job: elastic RL of a tiny local LLM agent on the learnable ``lookup`` task, on Ray.

    python examples/train_elastic.py                     # ~3-4 min on 2 CPU cores
    python examples/train_elastic.py --engine hf --steps 25 --out out/elastic

One command: starts an embedded local Ray, builds a tiny model + tokenizer (a ChatML chat
template, Hermes ``<tool_call>`` JSON tool calls: the template path a user's own model takes)
and warm-starts it on the task's format (cached under --workdir), runs elastic training on 2
cells (each cell hosts a vLLM engine runner and an RLlib Learner and switches role on its own:
staleness bound 0 makes each cell move between rollout and training every step or two), shows a
progress bar and a per-step table, then writes a timeline PNG of the cells' roles and prints a
summary with the number of role switches per cell.

The job runs the tiny lookup recipe, set explicitly (``tools.train.run_training``:
``XLongConfig().lookup_recipe()``: lr 5e-4, short calls, 4 calls a run), not the defaults,
which are for real 1.5B–8B policies (docs/own-task.md).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

import numpy as np

CELLS = 2
"""Cells of the main job."""
STALENESS_BOUND = 0
"""Staleness bound of the main job: each step's runs start on the newest weights, so when a
step ends nothing is left to train, the training cell goes back to rollout, and a cell drains
as soon as the next step's first group ends: every cell changes role every step or two. (With
bound 1 the rollout cell runs a step ahead, a group is always ready when a step ends, and one
cell stays in rollout, the other in training, for the whole job: async in effect.)"""


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    from tqdm import tqdm

    from ray_xlong.jobs.train import HEADER, row, run_training
    from ray_xlong.sim.timeline import plot_timelines

    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    bar = tqdm(total=args.steps, desc=f"{args.mode} ({args.engine})", unit="step",
               file=sys.stderr)
    rows: list[str] = []

    def on_step(report) -> None:
        if not rows:
            tqdm.write(HEADER)
        rows.append(row(report))
        tqdm.write(rows[-1])
        sys.stdout.flush()
        bar.set_postfix(reward=f"{report.reward_mean:.2f}")
        bar.update(1)

    warm = None
    if args.smoke:
        from ray_xlong.rollout.lookup_recipe import WarmStartConfig

        warm = WarmStartConfig(clean_steps=5, noisy_steps=2, min_accuracy=0.0)  # plumbing only
    run = run_training(mode=args.mode, steps=args.steps, seed=args.seed, engine=args.engine,
                       workdir=args.workdir, cells=args.cells, groups=args.groups,
                       staleness_bound=args.staleness_bound,
                       runs_per_group=args.runs_per_group, warm=warm, chat=args.chat,
                       on_step=on_step)
    bar.close()
    plot_timelines({f"{run.mode} ({run.engine})": run.events}, str(out / "timeline.png"),
                   title="cells by role (rollout / draining / training / syncing)",
                   time_unit="seconds")
    summary = summarize(run, total_s=time.perf_counter() - start)
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    (out / "steps.md").write_text("\n".join([HEADER, *rows]) + "\n")
    print_summary(summary, out)
    return 0


def summarize(run, *, total_s: float) -> dict:
    """What the job did, as JSON-ready numbers."""
    from ray_xlong.sim.metrics import role_switches

    r = np.asarray(run.rewards)
    k = min(3, len(r))
    switches = role_switches(run.events)
    return {"mode": run.mode, "engine": run.engine, "seed": run.seed, "steps": len(r),
            "role_switches": sum(switches.values()),
            "role_switches_per_cell": {str(c): n for c, n in switches.items()},
            "rewards": [round(float(x), 4) for x in r],
            "reward_first3": float(r[:k].mean()), "reward_last3": float(r[-k:].mean()),
            "tokens_trained": int(sum(x.tokens_trained for x in run.reports)),
            "gpu_busy_frac": float(run.reports[-1].gpu_busy_frac),
            "warm_start_s": run.warm_start_s, "startup_s": run.startup_s,
            "train_s": run.train_s, "total_s": total_s}


def print_summary(s: dict, out: pathlib.Path) -> None:
    print(f"\n{s['mode']} on {s['engine']} engines, seed {s['seed']}: {s['steps']} steps, "
          f"reward {s['reward_first3']:.3f} (first 3) -> {s['reward_last3']:.3f} (last 3), "
          f"{s['tokens_trained']} tokens trained, busy {s['gpu_busy_frac']:.2f}")
    per_cell = ", ".join(f"cell {c}: {n}" for c, n in s["role_switches_per_cell"].items())
    print(f"role switches: {s['role_switches']} ({per_cell})")
    print(f"time: warm start {s['warm_start_s']:.0f} s, cells up {s['startup_s']:.0f} s, "
          f"training {s['train_s']:.0f} s, total {s['total_s']:.0f} s")
    print(f"wrote {out / 'timeline.png'}, {out / 'summary.json'}, {out / 'steps.md'}")


def parse(argv: list[str] | None) -> argparse.Namespace:
    from ray_xlong.cli_args import int_at_least
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", default="elastic",
                   choices=["colocated", "async", "elastic", "colocated+streaming",
                            "async+streaming"])
    p.add_argument("--engine", default="vllm", choices=["hf", "vllm"])
    p.add_argument("--steps", type=int_at_least(1), default=25)
    p.add_argument("--seed", type=int_at_least(0), default=1)
    p.add_argument("--cells", type=int_at_least(1), default=CELLS, help="elastic cells")
    p.add_argument("--staleness-bound", type=int_at_least(0), default=STALENESS_BOUND,
                   help="max policy versions between a run's start and its training step")
    p.add_argument("--groups", type=int_at_least(1), default=16, help="task instances per step")
    p.add_argument("--runs-per-group", type=int_at_least(1), default=8)
    p.add_argument("--chat", default="chatml_tiny",
                   choices=["chatml_tiny", "chatml", "llama3", "token"],
                   help="the policy's chat format: a ChatML template with Hermes tool calls "
                        "(default), another template, or the demo model's own tokens")
    p.add_argument("--workdir", default=".cache/ray_xlong", help="model cache")
    p.add_argument("--out", default="out/train_elastic", help="timeline, summary, table")
    p.add_argument("--smoke", action="store_true",
                   help="tiny budget (CI): 2 steps of 2 groups x 2 runs, a 7-step warm start")
    args = p.parse_args(argv)
    if args.smoke:
        args.steps, args.groups, args.runs_per_group = 2, 2, 2
    return args


if __name__ == "__main__":
    sys.exit(main())
