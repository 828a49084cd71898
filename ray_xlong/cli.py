"""``ray-xlong``: the command line (also ``python -m ray_xlong.cli``).

    ray-xlong synth    --out runs.jsonl [--paper] [--groups G --runs-per-group R]
    ray-xlong inspect  runs.jsonl [--run RUN] [--max-trajectories 5] [--tree-tokens 8]
    ray-xlong sim      [--preset paper-2.4t] [--seed 0] [--steps N] [--events-dir DIR]
    ray-xlong timeline events.jsonl [more.jsonl ...] --out timeline.png
    ray-xlong train    [--mode elastic] [--engine vllm|hf] [--steps 25] [--seed 1] [--out DIR]

Files: runs are JSONL (schema in ``ray_xlong/trajectory/recording.py``); event logs are JSONL
of ``ray_xlong.scheduling.events.Event`` (the simulator and the Ray driver write the same).
Every command validates its input and says what to change when it cannot proceed.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time
from typing import Sequence


class CliError(Exception):
    """A user error: printed without a traceback, exit status 2."""


def cmd_synth(args: argparse.Namespace) -> int:
    from ray_xlong.trajectory.recording import write_runs
    from ray_xlong.trajectory.synthetic import SyntheticConfig, synthetic_runs

    config = SyntheticConfig.paper() if args.paper else SyntheticConfig()
    runs = synthetic_runs(args.seed, groups=args.groups, runs_per_group=args.runs_per_group,
                          config=config)
    write_runs(args.out, runs)
    calls = sum(len(r.calls) for r in runs)
    print(f"wrote {len(runs)} runs ({calls} calls) to {args.out}")
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    from ray_xlong.trajectory import ProcessorConfig, TrajectoryProcessor
    from ray_xlong.trajectory.recording import read_runs

    runs = read_runs(_existing(args.runs))
    if args.run:
        runs = [r for r in runs if r.run_id in args.run]
        missing = set(args.run) - {r.run_id for r in runs}
        if missing:
            raise CliError(f"no run {sorted(missing)} in {args.runs}")
    start = time.perf_counter()
    batch = TrajectoryProcessor(ProcessorConfig(max_trajectories_per_run=args.max_trajectories,
                                                pack="none")).process(runs)
    elapsed = time.perf_counter() - start
    for run in runs:
        _print_run(run, batch, args)
    s = batch.stats
    print(f"\n{len(runs)} runs processed in {elapsed:.3f} s: {s.trajectories_kept} trajectories "
          f"kept, {s.trajectories_dropped} dropped; tokens Σ {s.total_tokens:,} → unique "
          f"{s.unique_tokens:,} (dedup {s.dedup_ratio:.2f}×), trainable {s.trainable_tokens:,}; "
          f"timeouts {s.runs_timeout}, failed {s.runs_failed}")
    return 0


def _print_run(run, batch, args: argparse.Namespace) -> None:
    print(f"\n# run {run.run_id} (group {run.group_id}): {len(run.calls)} calls, "
          f"status {run.status}, reward {run.reward:g}")
    if run.status == "failed":
        print("  failed: not trained, not in its group's baseline")
        return
    kept = [t for t in batch.trajectories if t.run_id == run.run_id]
    dropped = [t for t in batch.dropped if t.run_id == run.run_id]
    print("  | # | kind | agent | origin | calls | tokens | generated | weighted |")
    print("  |---|---|---|---|---|---|---|---|")
    for i, t in enumerate(kept):
        print(f"  | {i} | {t.kind} | {t.agent_id} | {t.origin} | {len(t.call_indices)} | "
              f"{t.num_tokens:,} | {t.num_generated:,} | {int(t.loss_weights.sum()):,} |")
    for t in dropped:
        print(f"  | dropped | {t.kind} | {t.agent_id} | {t.origin} | {len(t.call_indices)} | "
              f"{t.num_tokens:,} | {t.num_generated:,} | 0 |")
    if not args.no_tree:
        tree_text = batch.trees[run.run_id].pretty_print(max_tokens=args.tree_tokens, file=False)
        print("\n".join("  " + line for line in tree_text.splitlines()))


def cmd_sim(args: argparse.Namespace) -> int:
    from ray_xlong.scheduling.events import to_jsonl
    from ray_xlong.sim.metrics import lower_bound_h, summarize
    from ray_xlong.sim.modes import make_policies, preset_workload, simulate_preset, with_steps
    from ray_xlong.sim.presets import get_preset

    try:
        preset = get_preset(args.preset)
    except (KeyError, ValueError) as exc:
        raise CliError(str(exc)) from exc
    if args.steps:
        preset = with_steps(preset, args.steps)
    workload = preset_workload(preset, seed=args.seed)
    bound = lower_bound_h(workload=workload, cluster=preset.cluster, costs=preset.costs,
                          config=preset.job)
    policies = make_policies(preset)
    modes = args.modes or list(policies)
    unknown = set(modes) - set(policies)
    if unknown:
        raise CliError(f"unknown mode(s) {sorted(unknown)}; choose from {sorted(policies)}")
    print(f"preset {args.preset}, seed {args.seed}: lower bound {bound:.2f} h\n")
    print("| mode | makespan h | ÷ lower bound | GPU idle % | staleness mean / max |")
    print("|---|---|---|---|---|")
    for mode in _progress(modes, "simulating"):
        result = simulate_preset(preset, policies[mode], seed=args.seed, workload=workload)
        s = summarize(result)
        print(f"| {mode} | {s.makespan_h:.2f} | {s.makespan_h / bound:.3f} | "
              f"{100 * s.gpu_idle_frac:.1f} | {s.staleness_mean:.2f} / {s.staleness_max} |")
        if args.events_dir:
            out = pathlib.Path(args.events_dir)
            out.mkdir(parents=True, exist_ok=True)
            (out / f"{mode}.jsonl").write_text(to_jsonl(result.events))
    if args.events_dir:
        print(f"\nevent logs in {args.events_dir}/<mode>.jsonl (draw: ray-xlong timeline)")
    return 0


def cmd_timeline(args: argparse.Namespace) -> int:
    from ray_xlong.scheduling.events import from_jsonl
    from ray_xlong.sim.timeline import plot_timelines

    logs = {}
    for name in args.events:
        path = pathlib.Path(_existing(name))
        try:
            events = from_jsonl(path.read_text())
        except (ValueError, KeyError, TypeError) as exc:
            raise CliError(f"{path} is not an event log (JSONL of Event records): {exc}") from exc
        if not events:
            raise CliError(f"{path} holds no events")
        logs[path.stem] = events
    plot_timelines(logs, args.out, title=args.title)
    print(f"wrote {args.out} ({len(logs)} panel{'s' if len(logs) > 1 else ''})")
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    """RL on the lookup task on a local Ray (the README main job; see examples/)."""
    from ray_xlong.rllib.train import HEADER, row, run_training
    from ray_xlong.sim.timeline import plot_timelines

    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print(HEADER, flush=True)
    run = run_training(mode=args.mode, steps=args.steps, seed=args.seed, engine=args.engine,
                       workdir=args.workdir, groups=args.groups,
                       runs_per_group=args.runs_per_group,
                       on_step=lambda r: print(row(r), flush=True))
    plot_timelines({f"{run.mode} ({run.engine})": run.events}, str(out / "timeline.png"),
                   time_unit="seconds")
    print(f"reward {run.rewards[0]:.3f} -> {run.rewards[-1]:.3f}; cells up {run.startup_s:.0f}"
          f" s, training {run.train_s:.0f} s; wrote {out / 'timeline.png'}")
    return 0


def _existing(path: str) -> str:
    if not pathlib.Path(path).is_file():
        raise CliError(f"{path}: no such file")
    return path


def _progress(items: Sequence, desc: str):
    try:
        from tqdm import tqdm
    except ImportError:
        return items
    return tqdm(items, desc=desc, leave=False, file=sys.stderr)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ray-xlong", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("synth", help="write seeded synthetic agent runs as JSONL")
    p.add_argument("--out", required=True, help="output .jsonl (or .jsonl.gz)")
    p.add_argument("--paper", action="store_true", help="paper scale: 636 calls, ~700k context")
    p.add_argument("--groups", type=int, default=1)
    p.add_argument("--runs-per-group", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(fn=cmd_synth)

    p = sub.add_parser("inspect", help="recorded runs → trajectories, trees, dedup stats")
    p.add_argument("runs", help="runs JSONL written by ray_xlong (see recording.py)")
    p.add_argument("--run", action="append", help="only this run id (repeatable)")
    p.add_argument("--max-trajectories", type=int, default=5, help="K kept per run")
    p.add_argument("--tree-tokens", type=int, default=8, help="tokens shown per tree node")
    p.add_argument("--no-tree", action="store_true", help="skip the tree drawing")
    p.set_defaults(fn=cmd_inspect)

    p = sub.add_parser("sim", help="scheduler simulator: every mode on a preset")
    p.add_argument("--preset", default="paper-2.4t")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=None, help="override the preset's steps")
    p.add_argument("--modes", nargs="*", default=None, help="subset of modes")
    p.add_argument("--events-dir", default=None, help="write each mode's event log here")
    p.set_defaults(fn=cmd_sim)

    p = sub.add_parser("timeline", help="event log(s) → per-cell Gantt PNG")
    p.add_argument("events", nargs="+", help="event log JSONL file(s), one panel each")
    p.add_argument("--out", required=True, help="output PNG")
    p.add_argument("--title", default="")
    p.set_defaults(fn=cmd_timeline)

    p = sub.add_parser("train", help="RL on the lookup task on cells of a local Ray")
    p.add_argument("--mode", default="elastic",
                   choices=["colocated", "async", "elastic", "colocated+streaming",
                            "async+streaming"])
    p.add_argument("--engine", default="vllm", choices=["hf", "vllm"])
    p.add_argument("--steps", type=int, default=25)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--groups", type=int, default=16)
    p.add_argument("--runs-per-group", type=int, default=8)
    p.add_argument("--workdir", default=".cache/ray_xlong", help="model cache")
    p.add_argument("--out", default="out/train", help="timeline PNG goes here")
    p.set_defaults(fn=cmd_train)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except CliError as exc:
        print(f"ray-xlong {args.command}: {exc}", file=sys.stderr)
        return 2
    except ValueError as exc:                       # validation errors name the field
        print(f"ray-xlong {args.command}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
