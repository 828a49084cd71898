"""``ray-xlong``: the command line (also ``python -m ray_xlong.cli``).

    ray-xlong synth    --out runs.jsonl [--paper] [--groups G --runs-per-group R]
    ray-xlong inspect  runs.jsonl [--run RUN] [--max-trajectories 5] [--tree-tokens 8]
    ray-xlong sim      [--preset paper-2.4t] [--seed 0] [--steps N] [--events-dir DIR]
    ray-xlong bench    [--backend sim|ray] [--modes ...] [--forecast] [--json PATH]
                       sim: [--preset paper-2.4t] [--steps N]   ray: [--size smoke|quick|full]
                       [--address auto] [--model-dir DIR] [--events-dir DIR]
    ray-xlong timeline events.jsonl [more.jsonl ...] --out timeline.png [--time-unit seconds]
    ray-xlong train    [--mode elastic] [--engine vllm|hf] [--steps 25] [--seed 1] [--out DIR]

Files: runs are JSONL (schema in ``ray_xlong/trajectory/recording.py``); event logs are JSONL
of ``ray_xlong.scheduling.events.Event`` (schema in ``ray_xlong/scheduling/events.py``; the
simulator writes them in hours, the Ray driver — ``train --out``, ``bench --backend ray
--events-dir`` — in wall seconds).
Every command validates its input and says what to change when it cannot proceed.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time
from typing import Sequence

from ray_xlong.scheduling.modes import ALL_MODES, CELL_MODES, PAPER_MODES  # the one registry


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


def cmd_bench(args: argparse.Namespace) -> int:
    """The mode comparison, in the simulator or on Ray cells; ratios against elastic."""
    modes = list(args.modes or PAPER_MODES)
    if args.forecast and "forecast" not in modes:
        modes.append("forecast")
    if "elastic" not in modes:
        raise CliError("--modes: the table's ratios are against elastic; include elastic")
    if args.backend == "sim":
        if args.size is not None or args.address is not None or args.model_dir is not None:
            raise CliError("--size / --address / --model-dir apply to --backend ray; for the "
                           "simulator use --preset and --steps")
        out, logs = _bench_sim(args, modes)
    else:
        if args.preset is not None or args.steps is not None:
            raise CliError("--preset / --steps apply to --backend sim; for Ray use --size "
                           "smoke|quick|full")
        out, logs = _bench_ray(args, modes)
    if args.json:
        import json

        pathlib.Path(args.json).write_text(json.dumps(out, indent=2))
        print(f"\nwrote {args.json}")
    if args.events_dir:
        from ray_xlong.scheduling.events import to_jsonl

        folder = pathlib.Path(args.events_dir)
        folder.mkdir(parents=True, exist_ok=True)
        for name, events in logs.items():
            (folder / f"{name}.jsonl").write_text(to_jsonl(events))
        unit = " --time-unit seconds" if args.backend == "ray" else ""
        print(f"event logs in {folder}/<mode>.jsonl (draw: ray-xlong timeline ...{unit})")
    return 0


def _bench_sim(args: argparse.Namespace, modes: list[str]) -> tuple[dict, dict]:
    from ray_xlong.sim.metrics import lower_bound_h, summarize
    from ray_xlong.sim.modes import make_policies, preset_workload, simulate_preset

    preset = _preset(args.preset or "paper-2.4t", args.steps)
    policies = make_policies(preset)
    _known_modes(modes, policies)
    workload = preset_workload(preset, seed=args.seed)
    bound = lower_bound_h(workload=workload, cluster=preset.cluster, costs=preset.costs,
                          config=preset.job)
    rows, logs = {}, {}
    for mode in _progress(modes, "simulating"):
        result = simulate_preset(preset, policies[mode], seed=args.seed, workload=workload)
        s = summarize(result)
        rows[mode] = {"makespan_h": s.makespan_h, "gpu_idle_frac": s.gpu_idle_frac,
                      "staleness_mean": s.staleness_mean, "staleness_max": s.staleness_max,
                      "over_lower_bound": s.makespan_h / bound}
        logs[mode] = result.events
    for row in rows.values():
        row["vs_elastic"] = row["makespan_h"] / rows["elastic"]["makespan_h"]
        row["speedup_vs_colocated"] = rows.get("colocated", row)["makespan_h"] / row["makespan_h"]
    print(f"simulator, preset {preset.name}, seed {args.seed}, {preset.job.total_steps} steps: "
          f"lower bound {bound:.2f} h\n")
    print("| mode | makespan h | ÷ elastic | × vs colocated | ÷ lower bound | GPU idle % | "
          "staleness mean / max |")
    print("|---|---|---|---|---|---|---|")
    for mode, r in rows.items():
        print(f"| {mode} | {r['makespan_h']:.2f} | {r['vs_elastic']:.3f} | "
              f"{r['speedup_vs_colocated']:.2f} | {r['over_lower_bound']:.3f} | "
              f"{100 * r['gpu_idle_frac']:.1f} | {r['staleness_mean']:.2f} / "
              f"{r['staleness_max']} |")
    out = {"backend": "sim", "preset": preset.name, "seed": args.seed,
           "steps": preset.job.total_steps, "lower_bound_h": bound, "modes": rows}
    return out, logs


def _bench_ray(args: argparse.Namespace, modes: list[str]) -> tuple[dict, dict]:
    import importlib.util

    if importlib.util.find_spec("ray") is None:
        raise CliError("--backend ray needs Ray RLlib: pip install -e '.[rllib]' (or use "
                       "--backend sim)")
    from ray_xlong.tools.mode_bench import run_comparison, table

    _known_modes(modes, ALL_MODES)
    size = args.size or "quick"
    if args.model_dir is not None and not pathlib.Path(args.model_dir, "config.json").is_file():
        raise CliError(f"--model-dir {args.model_dir}: not a HF model directory (no "
                       "config.json)")
    run = run_comparison(size=size, seed=args.seed, modes=modes, address=args.address,
                         model_dir=args.model_dir,
                         on_mode=lambda m: print(f"running {m} on Ray cells ...",
                                                 file=sys.stderr, flush=True))
    s = run.summary
    print(f"Ray cells ({size}, seed {args.seed}): {s['cells']} cells, lower bound "
          f"{s['lower_bound_s']:.2f} s, cells up in {s['cells_startup_s']:.1f} s; 'sim' and "
          f"(…): the simulator on the same workload\n")
    print(table(s["modes"]))
    logs = {}
    for mode, (real, sim) in run.logs.items():
        logs[mode], logs[f"{mode}-sim"] = real, sim
    return dict(s, backend="ray"), logs


def _preset(name: str, steps: int | None):
    from ray_xlong.sim.modes import with_steps
    from ray_xlong.sim.presets import get_preset

    try:
        preset = get_preset(name)
    except (KeyError, ValueError) as exc:
        raise CliError(str(exc)) from exc
    if steps is not None:
        if steps < 1:
            raise CliError(f"--steps must be >= 1, got {steps}")
        preset = with_steps(preset, steps)
    return preset


def _known_modes(modes: Sequence[str], known) -> None:
    unknown = sorted(set(modes) - set(known))
    if unknown:
        raise CliError(f"unknown mode(s) {unknown}; choose from {sorted(known)}")


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
    plot_timelines(logs, args.out, title=args.title, time_unit=args.time_unit)
    print(f"wrote {args.out} ({len(logs)} panel{'s' if len(logs) > 1 else ''})")
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    """RL on the lookup task on a local Ray (the README main job; see examples/)."""
    from ray_xlong.tools.train import HEADER, row, run_training
    from ray_xlong.scheduling.events import to_jsonl
    from ray_xlong.sim.timeline import plot_timelines

    import ray

    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print(HEADER, flush=True)
    owned = not ray.is_initialized()          # the embedded Ray run_training starts goes after
    try:
        run = run_training(mode=args.mode, steps=args.steps, seed=args.seed,
                           engine=args.engine, workdir=args.workdir, groups=args.groups,
                           runs_per_group=args.runs_per_group,
                           on_step=lambda r: print(row(r), flush=True))
    finally:
        if owned:
            ray.shutdown()
    (out / "events.jsonl").write_text(to_jsonl(run.events))
    plot_timelines({f"{run.mode} ({run.engine})": run.events}, str(out / "timeline.png"),
                   time_unit="seconds")
    print(f"reward {run.rewards[0]:.3f} -> {run.rewards[-1]:.3f}; cells up {run.startup_s:.0f}"
          f" s, training {run.train_s:.0f} s; wrote {out / 'timeline.png'} and "
          f"{out / 'events.jsonl'} (ray-xlong timeline ... --time-unit seconds)")
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

    p = sub.add_parser(
        "bench", help="the mode comparison (colocated / async / elastic [/ forecast]), "
        "in the simulator or on Ray cells", description=cmd_bench.__doc__ + " The table "
        "gives each mode's makespan ÷ elastic's (< 1: faster than elastic).")
    p.add_argument("--backend", default="sim", choices=["sim", "ray"],
                   help="sim: the discrete-event simulator on a preset (seconds); ray: real "
                   "cells on Ray, each mode beside the simulator on the same workload (minutes)")
    p.add_argument("--modes", nargs="+", default=None,
                   help="modes to run (default colocated async elastic; must include elastic)")
    p.add_argument("--forecast", action="store_true",
                   help="also run our forecast mode")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--preset", default=None, help="sim: preset (default paper-2.4t)")
    p.add_argument("--steps", type=int, default=None, help="sim: override the preset's steps")
    p.add_argument("--size", default=None, choices=["smoke", "quick", "full"],
                   help="ray: job size (default quick; smoke ~1 min on 2 CPUs)")
    p.add_argument("--address", default=None,
                   help="ray: join this cluster (e.g. auto after `ray start`) instead of an "
                   "embedded local Ray")
    p.add_argument("--model-dir", default=None,
                   help="ray: policy model (HF directory every node can read; default: a tiny "
                   "one built locally, fine on one machine)")
    p.add_argument("--json", default=None, help="write the rows and settings as JSON here")
    p.add_argument("--events-dir", default=None, help="write each mode's event log here")
    p.set_defaults(fn=cmd_bench)

    p = sub.add_parser("timeline", help="event log(s) → per-cell Gantt PNG")
    p.add_argument("events", nargs="+", help="event log JSONL file(s), one panel each")
    p.add_argument("--out", required=True, help="output PNG")
    p.add_argument("--title", default="")
    p.add_argument("--time-unit", default="hours", choices=["hours", "seconds"],
                   help="axis label: the simulator logs hours, the Ray driver wall seconds")
    p.set_defaults(fn=cmd_timeline)

    p = sub.add_parser("train", help="RL on the lookup task on cells of a local Ray")
    p.add_argument("--mode", default="elastic",
                   choices=list(CELL_MODES))
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
