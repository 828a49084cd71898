"""Scheduler simulator benchmark: the paper's table, the streaming ablation and sweeps.

    python benchmarks/scheduler_sim.py --preset paper-2.4t[-drift|-shift] --seed 0 --json out.json \
        [--plot timeline.png] [--steps 2 --no-sweeps] [--compare-seeds 0 1 2 3 4]

Prints markdown tables (every mode side by side on one sampled workload) and writes JSON shaped
``{"preset", "seed", "lower_bound_h", "paper_h", "modes": {mode: {"makespan_h", "gpu_idle_frac",
...}}, "sweeps": [...], "seed_comparison": [...], "sim_wall_s_max"}`` (the slowest simulation
but planned's, whose row adds ``plans``, ``plan_wall_s_max``, ``plan_wall_s_total``,
``final_plan``). Sweep rows hold ``{sweep, value, lower_bound_h, colocated_h, async_h,
elastic_h, forecast_h, best_static_h, best_static_rollout_cells, planned_h,
planned_vs_best_baseline, planned_plans, planned_plan_wall_s_max, planned_sim_wall_s_max
(the slowest candidate simulation of a plan, mean over its candidates), ...}`` (``--sweeps-only``
skips the mode table; ``--no-planned`` the planned policy). ``forecast`` is our own
mode (``ray_xlong/scheduling/forecast.py``); ``best_static`` is async with the split found best
with hindsight on the same workload (its row has ``split: {rollout_cells, training_cells}``; every
row has ``speedup_vs_best_static``); ``--compare-seeds`` prints elastic vs forecast per
seed (and elastic with the newest-run drain choice alone, to separate the two ideas);
``--gap`` prints, for planned, forecast and the best fixed split at ``--points`` (default 16 and
32 cells), where the makespan goes against the staleness admission bound
(``sim.metrics.window_parts``).
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # benchmarks.tools
from benchmarks.tools.entry import bench_parser, finish  # noqa: E402
from ray_xlong.scheduling.asynchronous import AsyncPolicy
from ray_xlong.scheduling.colocated import ColocatedPolicy
from ray_xlong.scheduling.elastic import ElasticPolicy
from ray_xlong.sim.metrics import bound_parts, lower_bound_h, summarize, window_parts
from ray_xlong.sim.modes import (
    best_static_split, forecast_policy, make_policies, preset_planner, preset_workload,
    simulate_preset, with_steps,
)
from ray_xlong.sim.presets import PAPER_HOURS, SIGMA, Z_61, Preset, get_preset
from ray_xlong.sim.timeline import plot_timelines


def run_modes(preset: Preset, *, seed: int) -> tuple[float, dict, dict]:
    """Simulate every mode on one workload; returns (lower bound, rows by mode, logs by mode)."""
    workload = preset_workload(preset, seed=seed)
    lb = lower_bound_h(workload=workload, cluster=preset.cluster, costs=preset.costs, config=preset.job)
    rows, logs = {}, {}
    for name, policy in make_policies(preset).items():
        t0 = time.perf_counter()
        result = simulate_preset(preset, policy, seed=seed, workload=workload)
        rows[name] = _row(result, lb, time.perf_counter() - t0)
        if hasattr(policy, "plans"):  # planned: its simulations of candidate plans
            walls = [plan.wall_s for plan in policy.plans]
            rows[name].update(plans=len(walls), plan_wall_s_max=max(walls, default=0.0),
                              plan_wall_s_total=sum(walls), final_plan=policy.current_label)
        logs[name] = result.events
    t0 = time.perf_counter()
    split, result = best_static_split(preset, workload=workload)
    splits = preset.cluster.cells - 1  # one simulation per split: report the mean
    rows["best_static"] = _row(result, lb, (time.perf_counter() - t0) / splits)
    rows["best_static"]["split"] = {"rollout_cells": split,
                                    "training_cells": preset.cluster.cells - split}
    logs["best_static"] = result.events
    for row in rows.values():
        row["speedup_vs_colocated"] = rows["colocated"]["makespan_h"] / row["makespan_h"]
        row["speedup_vs_async"] = rows["async"]["makespan_h"] / row["makespan_h"]
        row["speedup_vs_best_static"] = rows["best_static"]["makespan_h"] / row["makespan_h"]
    return lb, rows, logs


def _row(result, lb: float, wall_s: float) -> dict:
    s = summarize(result)
    return {
        "makespan_h": s.makespan_h, "gpu_idle_frac": s.gpu_idle_frac,
        "staleness_mean": s.staleness_mean, "staleness_max": s.staleness_max,
        "over_lower_bound": s.makespan_h / lb, "runs": s.runs, "steps": s.steps,
        "sim_wall_s": wall_s,
    }


def table(rows: dict, *, paper: bool) -> str:
    """Markdown table of mode rows."""
    head = ("| mode | makespan h | × vs colocated | × vs async | × vs best_static | ÷ lower bound | "
            "GPU idle % | staleness mean / max |")
    head += " paper h |" if paper else ""
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for name, r in rows.items():
        split = f" ({r['split']['rollout_cells']}/{r['split']['training_cells']})" if "split" in r else ""
        line = (f"| {name}{split} | {r['makespan_h']:.2f} | {r['speedup_vs_colocated']:.2f} | "
                f"{r['speedup_vs_async']:.2f} | {r['speedup_vs_best_static']:.3f} | "
                f"{r['over_lower_bound']:.3f} | "
                f"{100 * r['gpu_idle_frac']:.1f} | {r['staleness_mean']:.2f} / {r['staleness_max']} |")
        if paper:
            line += f" {PAPER_HOURS.get(name, float('nan')):.2f} |".replace("nan", "–")
        lines.append(line)
    return "\n".join(lines)


def sweep_variants(preset: Preset) -> list[tuple[str, str, Preset]]:
    """(sweep, value, preset) for cells, tail heaviness and staleness bound."""
    out = []
    for cells in (2, 4, 8, 16, 32):
        r = min(cells - 1, max(1, round(preset.async_rollout_cells * cells / preset.cluster.cells)))
        p = dataclasses.replace(preset, cluster=dataclasses.replace(preset.cluster, cells=cells),
                                async_rollout_cells=r)
        out.append(("cells", str(cells), p))
    for sigma in (0.3, SIGMA, 1.2):  # median re-derived so that 61% of runs stay >= 4 h
        w = dataclasses.replace(preset.workload, sigma=sigma, median_run_h=4 * math.exp(Z_61 * sigma))
        out.append(("tail sigma", str(sigma), dataclasses.replace(preset, workload=w)))
    for bound in (1, 3, 7, 15):
        job = dataclasses.replace(preset.job, staleness_bound=bound)
        out.append(("staleness bound", str(bound), dataclasses.replace(preset, job=job)))
    return out


def run_sweeps(preset: Preset, *, seed: int, planned: bool = True,
               points: list[str] | None = None) -> list[dict]:
    """Colocated / async / elastic / forecast, the best fixed split by hindsight and the
    planned policy on every sweep variant (``points``: only these, as ``"sweep=value"``)."""
    rows = []
    for sweep, value, p in sweep_variants(preset):
        if points and f"{sweep}={value}" not in points:
            continue
        w = preset_workload(p, seed=seed)
        lb = lower_bound_h(workload=w, cluster=p.cluster, costs=p.costs, config=p.job)
        policies = {"colocated": ColocatedPolicy(),
                    "async": AsyncPolicy(rollout_cells=p.async_rollout_cells),
                    "elastic": ElasticPolicy(), "forecast": forecast_policy(p)}
        hours = {n: simulate_preset(p, pol, seed=seed, workload=w).makespan_h for n, pol in policies.items()}
        split, best = best_static_split(p, workload=w, coarse=True)
        row = {"sweep": sweep, "value": value, "lower_bound_h": lb,
               **{f"{n}_h": h for n, h in hours.items()},
               "elastic_vs_colocated": hours["colocated"] / hours["elastic"],
               "elastic_vs_async": hours["async"] / hours["elastic"],
               "forecast_vs_elastic": hours["elastic"] / hours["forecast"],
               "best_static_h": best.makespan_h, "best_static_rollout_cells": split}
        if planned:
            row.update(_planned_row(p, w, seed=seed, row=row))
        print(json.dumps(row), flush=True)  # progress: a sweep takes minutes
        rows.append(row)
    return rows


def _planned_row(p: Preset, w, *, seed: int, row: dict) -> dict:
    """``planned_h``, its ratio to the best of the baselines, and the plans' driver cost."""
    policy = preset_planner(p)
    h = simulate_preset(p, policy, seed=seed, workload=w).makespan_h
    best = min(row[k] for k in ("colocated_h", "async_h", "elastic_h", "best_static_h"))
    walls = [plan.wall_s for plan in policy.plans]
    return {"planned_h": h, "planned_vs_best_baseline": h / best,
            "planned_plans": len(walls), "planned_plan_wall_s_max": max(walls, default=0.0),
            "planned_plan_wall_s_total": sum(walls),
            "planned_sim_wall_s_max": max((plan.wall_s / max(1, len(plan.predicted))
                                           for plan in policy.plans), default=0.0),
            "planned_final_plan": policy.current_label}


def bounds_table(preset: Preset, *, seed: int) -> tuple[list[dict], str]:
    """The parts of the lower bound (work, chain, staleness admission) at every sweep point:
    which one binds (no simulation)."""
    rows, lines = [], ["| sweep | value | work h | chain h | admission h | binds |",
                       "|---|---|---|---|---|---|"]
    for sweep, value, p in sweep_variants(preset):
        w = preset_workload(p, seed=seed)
        parts = bound_parts(workload=w, cluster=p.cluster, costs=p.costs, config=p.job)
        rows.append({"sweep": sweep, "value": value, **{f"{k}_h": v for k, v in parts.items()}})
        lines.append(f"| {sweep} | {value} | {parts['work']:.2f} | {parts['chain']:.2f} | "
                     f"{parts['admission']:.2f} | {max(parts, key=parts.get)} |")
    return rows, "\n".join(lines)


def gap_table(preset: Preset, *, seed: int, points: list[str]) -> tuple[list[dict], str]:
    """Why a point stays above its lower bound: for planned, forecast and the best fixed split,
    the staleness window's parts (``sim.metrics.window_parts``) beside the bound's parts."""
    head = ("| point | mode | makespan h | admission bound h | work bound h | Σ hold ÷ window h | "
            "window not full h | per group: longest run h | + stagger h | + ready → taken h | "
            "+ taken → step end h |")
    rows, lines = [], [head, "|---|---|---|---|---|---|---|---|---|---|---|"]
    for sweep, value, p in sweep_variants(preset):
        if f"{sweep}={value}" not in points:
            continue
        w = preset_workload(p, seed=seed)
        parts = bound_parts(workload=w, cluster=p.cluster, costs=p.costs, config=p.job)
        split, best = best_static_split(p, workload=w, coarse=True)
        results = {"planned": simulate_preset(p, preset_planner(p), seed=seed, workload=w),
                   "forecast": simulate_preset(p, forecast_policy(p), seed=seed, workload=w),
                   f"best_static ({split})": best}
        for mode, result in results.items():
            wp = window_parts(result, p.job)
            rows.append({"sweep": sweep, "value": value, "mode": mode,
                         "makespan_h": result.makespan_h,
                         **{f"bound_{k}_h": v for k, v in parts.items()}, **wp})
            lines.append(
                f"| {sweep} {value} | {mode} | {result.makespan_h:.2f} | "
                f"{parts['admission']:.2f} | {parts['work']:.2f} | {wp['full_window_h']:.2f} | "
                f"{wp['not_full_h']:.2f} | {wp['longest_h']:.2f} | {wp['stagger_h']:.2f} | "
                f"{wp['ready_h']:.2f} | {wp['step_h']:.2f} |")
    return rows, "\n".join(lines)


def sweep_table(rows: list[dict]) -> str:
    """Markdown table of the sweeps."""
    lines = ["| sweep | value | lower bound h | colocated h | async h | elastic h | forecast h | "
             "best_static h (split) | planned h | planned ÷ best of colocated/async/elastic/"
             "best_static | elastic × vs colocated | forecast × vs elastic |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        planned = f"{r['planned_h']:.2f}" if "planned_h" in r else "–"
        ratio = f"{r['planned_vs_best_baseline']:.3f}" if "planned_h" in r else "–"
        lines.append(f"| {r['sweep']} | {r['value']} | {r['lower_bound_h']:.2f} | {r['colocated_h']:.2f} | "
                     f"{r['async_h']:.2f} | {r['elastic_h']:.2f} | {r['forecast_h']:.2f} | "
                     f"{r['best_static_h']:.2f} ({r['best_static_rollout_cells']}) | {planned} | "
                     f"{ratio} | {r['elastic_vs_colocated']:.2f} | {r['forecast_vs_elastic']:.2f} |")
    return "\n".join(lines)


def newest_run_first(state, cells):
    """Elastic's drain choice swapped for forecast's: the cell whose newest run is oldest."""
    return min(cells, key=lambda c: (c.newest_run_start, c.live_runs, c.cell))


def compare_seeds(preset: Preset, seeds: list[int]) -> list[dict]:
    """Elastic vs forecast (and elastic + newest-run drain choice) on several workloads."""
    rows = []
    for seed in seeds:
        w = preset_workload(preset, seed=seed)
        lb = lower_bound_h(workload=w, cluster=preset.cluster, costs=preset.costs, config=preset.job)
        policies = {"elastic": ElasticPolicy(), "forecast": forecast_policy(preset),
                    "elastic_newest_pick": ElasticPolicy(pick_drain=newest_run_first)}
        hours = {n: simulate_preset(preset, pol, seed=seed, workload=w).makespan_h
                 for n, pol in policies.items()}
        rows.append({"seed": seed, "lower_bound_h": lb, **{f"{n}_h": h for n, h in hours.items()},
                     "forecast_vs_elastic": hours["elastic"] / hours["forecast"]})
    return rows


def seed_table(rows: list[dict]) -> str:
    """Markdown table of :func:`compare_seeds` plus a mean row."""
    lines = ["| seed | lower bound h | elastic h (÷ LB) | forecast h (÷ LB) | forecast × vs elastic | "
             "elastic + newest-run drain choice h |", "|---|---|---|---|---|---|"]
    for r in rows:
        lb = r["lower_bound_h"]
        lines.append(f"| {r['seed']} | {lb:.2f} | {r['elastic_h']:.2f} ({r['elastic_h'] / lb:.3f}) | "
                     f"{r['forecast_h']:.2f} ({r['forecast_h'] / lb:.3f}) | "
                     f"{r['forecast_vs_elastic']:.3f} | {r['elastic_newest_pick_h']:.2f} |")
    mean = {k: sum(r[k] for r in rows) / len(rows) for k in rows[0] if k != "seed"}
    wins = sum(r["forecast_h"] < r["elastic_h"] for r in rows)
    lines.append(f"| mean | {mean['lower_bound_h']:.2f} | {mean['elastic_h']:.2f} | "
                 f"{mean['forecast_h']:.2f} | {mean['forecast_vs_elastic']:.3f} "
                 f"(forecast wins {wins}/{len(rows)}) | {mean['elastic_newest_pick_h']:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    ap = bench_parser(__doc__, smoke=False)
    ap.add_argument("--preset", default="paper-2.4t")
    ap.add_argument("--plot", default=None, help="per-cell Gantt PNG of every mode")
    ap.add_argument("--steps", type=int, default=None, help="override the preset's steps (smoke runs)")
    ap.add_argument("--no-sweeps", action="store_true", help="skip the sweeps")
    ap.add_argument("--sweeps-only", action="store_true", help="skip the mode table")
    ap.add_argument("--points", nargs="*", default=None,
                    help='only these sweep points, e.g. "cells=16" "staleness bound=3"')
    ap.add_argument("--bounds", action="store_true",
                    help="print the lower bound's parts at every sweep point and exit")
    ap.add_argument("--gap", action="store_true",
                    help="why the --points (default cells=16, cells=32) stay above the lower "
                         "bound: the staleness window's parts; then exit")
    ap.add_argument("--no-planned", action="store_true",
                    help="sweeps without the planned policy (it plans with the simulator)")
    ap.add_argument("--compare-seeds", type=int, nargs="*", default=None,
                    help="also run elastic vs forecast on these seeds")
    args = ap.parse_args(argv)
    preset = get_preset(args.preset)
    if args.steps is not None:
        preset = with_steps(preset, args.steps)
    out = {"preset": preset.name, "seed": args.seed, "steps": preset.job.total_steps,
           "paper_h": PAPER_HOURS}
    if args.bounds:
        out["bounds"], text = bounds_table(preset, seed=args.seed)
        print(text)
        return out
    if args.gap:
        out["gap"], text = gap_table(preset, seed=args.seed,
                                     points=args.points or ["cells=16", "cells=32"])
        print(text)
        return finish(out, show=lambda _: None, json_path=args.json)
    logs: dict = {}
    if not args.sweeps_only:
        lb, rows, logs = run_modes(preset, seed=args.seed)
        print(f"## {preset.name}, seed {args.seed}: {preset.job.total_steps} steps, "
              f"{preset.job.total_runs} runs, lower bound {lb:.2f} h\n")
        print(table(rows, paper=args.steps is None and preset.name == "paper-2.4t") + "\n")
        out.update(lower_bound_h=lb, modes=rows,
                   sim_wall_s_max=max(r["sim_wall_s"] for n, r in rows.items() if n != "planned"))
        print(f"slowest single simulation: {out['sim_wall_s_max']:.2f} s (planned, with its "
              f"plans: {rows['planned']['sim_wall_s']:.1f} s; {rows['planned']['plans']} plans, "
              f"the longest {rows['planned']['plan_wall_s_max']:.2f} s)\n")
    if not args.no_sweeps:
        out["sweeps"] = run_sweeps(preset, seed=args.seed, planned=not args.no_planned,
                                   points=args.points)
        print(sweep_table(out["sweeps"]) + "\n")
    if args.compare_seeds:
        out["seed_comparison"] = compare_seeds(preset, args.compare_seeds)
        print(seed_table(out["seed_comparison"]) + "\n")
    if args.plot and logs:
        shown = ("colocated", "async", "elastic", "forecast", "best_static")
        plot_timelines({m: logs[m] for m in shown}, args.plot,
                       title=f"{preset.name} seed {args.seed}: per-cell roles")
        print(f"timeline written to {args.plot}")
    return finish(out, show=lambda _: None, json_path=args.json)      # tables printed above


if __name__ == "__main__":
    main()
