"""Learning benchmark: colocated, async and elastic with the same seed and budget on real cells.

    python benchmarks/learning.py --json out/learning.json [--seeds 1 2 3] [--steps 25]
    python benchmarks/learning.py --smoke --json out/learning_smoke.json     # tiny budget (CI)
    python benchmarks/learning.py --modes elastic --corrections all --steps 30 --json out/c.json

``--corrections`` trains each named off-policy correction (:data:`CORRECTIONS`, the
``LossConfig`` of each) in every mode: a row per (mode, correction); the default is the token
PPO clip alone (row name = the mode).

Each (mode, seed) trains the warm-started tiny policy on the ``lookup`` task for ``--steps``
steps (16 groups × 8 runs, lr 5e-4: the local RL recipe) on 2 cells of an embedded local Ray.
Prints the reward curves and a markdown table (first-3 / last-5 mean reward, rise, seconds, and
the spread of the final reward over seeds, i.e. the run-to-run noise) and writes JSON::

    {"modes": {"colocated": {"rewards": [per-step mean reward of the first seed],
                             "seconds": x, "seeds": {seed: {"rewards": [...], "seconds": x}},
                             "final_mean": f, "final_std": s, "rise_mean": r}, "async": …, …},
     "steps": n, "groups": g, "runs_per_group": r, "engine": "hf"}
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import tempfile

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # benchmarks.tools
from benchmarks.tools.entry import bench_parser, finish  # noqa: E402

from ray_xlong.scheduling.modes import PAPER_MODES as MODES  # the one mode registry
from ray_xlong.trajectory import LossConfig

CORRECTIONS = {
    "token_ppo": LossConfig(),
    "seq_tis": LossConfig(kind="tis", ratio_level="sequence", tis_cap=2.0),
    "geo_ppo": LossConfig(ratio_level="geo_mean"),
    "token_mask": LossConfig(token_mask=(0.5, 2.0)),
    "seq_mask": LossConfig(kind="tis", sequence_mask=(0.8, 1.25)),
    "kl_k3_ref": LossConfig(kl_coef=0.01, kl_estimator="k3", kl_reference="reference"),
    "kl_k1_behaviour": LossConfig(kl_coef=0.01, kl_estimator="k1"),
}
"""Off-policy corrections ``--corrections`` can name (``trajectory/loss.py``)."""


def run(args: argparse.Namespace) -> dict:
    from ray_xlong.jobs.train import run_training
    from ray_xlong.rollout.lookup_recipe import WarmStartConfig

    warm = (WarmStartConfig(clean_steps=5, noisy_steps=2, min_accuracy=0.0)  # plumbing only
            if args.smoke else None)
    out: dict = {"modes": {}, "steps": args.steps, "groups": args.groups,
                 "runs_per_group": args.runs_per_group, "engine": args.engine,
                 "chat": args.chat,
                 "seeds": args.seeds}
    out["corrections"] = args.corrections
    for mode, correction in [(m, c) for m in args.modes for c in args.corrections or [None]]:
        name = mode if correction is None else f"{mode}/{correction}"
        per_seed = {}
        for seed in args.seeds:
            r = run_training(mode=mode, steps=args.steps, seed=seed, workdir=args.workdir,
                             engine=args.engine, groups=args.groups,
                             runs_per_group=args.runs_per_group, warm=warm, chat=args.chat,
                             loss=CORRECTIONS[correction] if correction else None)
            per_seed[seed] = {"rewards": list(r.rewards), "seconds": r.train_s,
                              "startup_s": r.startup_s}
            print(f"{name} seed {seed}: " + " ".join(f"{x:.2f}" for x in r.rewards)
                  + f"  ({r.train_s:.0f} s)", flush=True)
        first = per_seed[args.seeds[0]]
        finals = [_mean(v["rewards"][-5:]) for v in per_seed.values()]
        rises = [_mean(v["rewards"][-5:]) - _mean(v["rewards"][:3]) for v in per_seed.values()]
        out["modes"][name] = {
            "rewards": first["rewards"], "seconds": first["seconds"],
            "seeds": {str(k): v for k, v in per_seed.items()},
            "final_mean": _mean(finals), "final_std": _std(finals), "rise_mean": _mean(rises),
            "seconds_mean": _mean([v["seconds"] for v in per_seed.values()])}
    return out


def _mean(xs) -> float:
    return float(statistics.fmean(xs)) if xs else 0.0


def _std(xs) -> float:
    return float(statistics.stdev(xs)) if len(xs) > 1 else 0.0


def table(result: dict) -> str:
    lines = ["| mode | reward first 3 | reward last 5 (mean over seeds ± std) | rise | "
             "train s | vs colocated |", "|---|---:|---:|---:|---:|---:|"]
    base = result["modes"].get("colocated", {}).get("seconds_mean")
    for mode, m in result["modes"].items():
        first3 = _mean([_mean(v["rewards"][:3]) for v in m["seeds"].values()])
        ratio = f"{m['seconds_mean'] / base:.2f}" if base else "-"
        lines.append(f"| {mode} | {first3:.3f} | {m['final_mean']:.3f} ± {m['final_std']:.3f} | "
                     f"{m['rise_mean']:+.3f} | {m['seconds_mean']:.0f} | {ratio} |")
    return "\n".join(lines)


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = bench_parser(__doc__, smoke=False, seed=False, json_required=True)
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--seeds", nargs="+", type=int, default=[1])
    p.add_argument("--steps", type=int, default=25)
    p.add_argument("--groups", type=int, default=16)
    p.add_argument("--runs-per-group", type=int, default=8)
    p.add_argument("--engine", default="hf", choices=["hf", "vllm"])
    p.add_argument("--chat", default="chatml_tiny",
                   choices=["chatml_tiny", "chatml", "llama3", "token"],
                   help="chat format of the policy (default: the template path)")
    p.add_argument("--corrections", nargs="+", default=None,
                   choices=[*CORRECTIONS, "all"],
                   help="off-policy corrections to train, each in every mode (default: none "
                        "named: the token PPO clip, one row per mode)")
    p.add_argument("--workdir", default=None, help="model cache (default: a temp dir)")
    p.add_argument("--smoke", action="store_true",
                   help="tiny budget: 1 step of 2 groups × 2 runs, a 7-step warm start")
    args = p.parse_args(argv)
    if args.corrections and "all" in args.corrections:
        args.corrections = list(CORRECTIONS)
    if args.smoke:
        args.steps, args.groups, args.runs_per_group = 1, 2, 2
    args.workdir = args.workdir or tempfile.mkdtemp(prefix="rx-learning-")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    finish(run(args), show=lambda result: print(table(result)), json_path=args.json)
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
