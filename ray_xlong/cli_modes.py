"""The scheduling-mode commands of ``ray-xlong``: ``sim`` (every mode in the simulator) and
``bench`` (the mode comparison, in the simulator at paper scale or on real Ray cells, with ratios
against elastic). Both simulate through :func:`_simulate_modes`; ``cli.py`` wires the parser.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
from typing import Sequence

from ray_xlong.cli_args import CliError, progress
from ray_xlong.scheduling.modes import ALL_MODES, PAPER_MODES  # the one registry


def cmd_sim(args: argparse.Namespace) -> int:
    """Every mode of a preset in the simulator: a table, and event logs with --events-dir."""
    preset = _preset(args.preset, args.steps or None)
    rows, logs, bound = _simulate_modes(preset, args.modes, seed=args.seed)
    print(f"preset {args.preset}, seed {args.seed}: lower bound {bound:.2f} h\n")
    print("| mode | makespan h | ÷ lower bound | GPU idle % | staleness mean / max |")
    print("|---|---|---|---|---|")
    for mode, r in rows.items():
        print(f"| {mode} | {r['makespan_h']:.2f} | {r['over_lower_bound']:.3f} | "
              f"{100 * r['gpu_idle_frac']:.1f} | {r['staleness_mean']:.2f} / "
              f"{r['staleness_max']} |")
    if args.events_dir:
        _write_logs(args.events_dir, logs)
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
        _write_logs(args.events_dir, logs)
        unit = " --time-unit seconds" if args.backend == "ray" else ""
        print(f"event logs in {args.events_dir}/<mode>.jsonl (draw: ray-xlong timeline ...{unit})")
    return 0


def _simulate_modes(preset, modes: Sequence[str] | None, *, seed: int
                    ) -> tuple[dict, dict, float]:
    """``(rows, event logs, lower bound h)`` of ``modes`` (None: every benchmarked mode) on
    the preset's workload of ``seed``; a row holds makespan, idle share, staleness and the
    ratio to the lower bound."""
    from ray_xlong.sim.metrics import lower_bound_h, summarize
    from ray_xlong.sim.modes import make_policies, preset_workload, simulate_preset

    policies = make_policies(preset)
    modes = list(modes or policies)
    _known_modes(modes, policies)
    workload = preset_workload(preset, seed=seed)
    bound = lower_bound_h(workload=workload, cluster=preset.cluster, costs=preset.costs,
                          config=preset.job)
    rows, logs = {}, {}
    for mode in progress(modes, "simulating"):
        result = simulate_preset(preset, policies[mode], seed=seed, workload=workload)
        s = summarize(result)
        rows[mode] = {"makespan_h": s.makespan_h, "gpu_idle_frac": s.gpu_idle_frac,
                      "staleness_mean": s.staleness_mean, "staleness_max": s.staleness_max,
                      "over_lower_bound": s.makespan_h / bound}
        logs[mode] = result.events
    return rows, logs, bound


def _bench_sim(args: argparse.Namespace, modes: list[str]) -> tuple[dict, dict]:
    preset = _preset(args.preset or "paper-2.4t", args.steps)
    rows, logs, bound = _simulate_modes(preset, modes, seed=args.seed)
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
    from ray_xlong.jobs.mode_bench import run_comparison, table

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


def _write_logs(folder: str, logs: dict) -> None:
    from ray_xlong.scheduling.events import to_jsonl

    out = pathlib.Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    for name, events in logs.items():
        (out / f"{name}.jsonl").write_text(to_jsonl(events))
