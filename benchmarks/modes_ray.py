"""The three modes on real Ray cells, side by side with the simulator on the same workload.

    python benchmarks/modes_ray.py --seed 0 [--quick | --smoke] [--json out.json] \
        [--plot-dir plots/]

One local Ray instance with logical GPUs; ``cells`` placement groups created once; every mode
runs the same seeded long-horizon job (time-compressed: one task hour is one wall second) on
the same cells. A calibration job first measures the cost model (per-call overhead, training
tokens/s, switch, sync, step finish); the simulator then runs every mode on the predicted
workload of the same job (each run's tool time replayed from its task seed). Prints a markdown
table and writes JSON shaped ``{"modes": {mode: {"makespan_s", "sim_makespan_s",
"gpu_busy_frac", ...}}, "lower_bound_s", "calibration", ...}`` and one timeline PNG per mode
(Ray above, simulator below: one plotting function for both logs).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import statistics
import tempfile
import time

MODES = ("colocated", "async", "elastic")

SIZES = {  # cells, steps, groups/step, runs/group, slots, async rollout cells, task steps,
    # median tool latency (task seconds; 3600 = one wall second)
    "smoke": dict(cells=2, steps=2, batch=2, group=2, slots=2, async_rollout=1, task_steps=3,
                  median_s=720.0),
    "quick": dict(cells=3, steps=3, batch=3, group=2, slots=2, async_rollout=2, task_steps=4,
                  median_s=2160.0),
    "full": dict(cells=4, steps=6, batch=4, group=2, slots=3, async_rollout=3, task_steps=6,
                 median_s=2160.0),
}


def build_config(size: dict, *, model_dir: str, seed: int):
    """The job of a size: ``task_steps`` tool calls of median ``median_s`` task seconds each,
    heavy-tailed (sigma 1), a run capped at 2.5 × task_steps × the median (wall clock)."""
    from ray_xlong.rllib.cells import CellLayout
    from ray_xlong.rllib.config import CellJobConfig
    from ray_xlong.rllib.learner import LearnerSettings
    from ray_xlong.rllib.long_horizon_job import LongHorizonJob
    from ray_xlong.rollout import HarnessConfig
    from ray_xlong.rollout.tasks import LongHorizonConfig
    from ray_xlong.scheduling import SchedulingConfig

    timeout = 2.5 * size["task_steps"] * size["median_s"] / 3600
    work = LongHorizonJob(task=LongHorizonConfig(
        num_steps=size["task_steps"], latency_median_s=size["median_s"], latency_sigma=1.0,
        time_scale=1 / 3600), seed=seed)
    return CellJobConfig(
        mode="colocated",
        job=SchedulingConfig(total_steps=size["steps"], batch_groups=size["batch"],
                             runs_per_group=size["group"], staleness_bound=1),
        layout=CellLayout(cells=size["cells"], nodes_per_cell=1, gpus_per_node=1),
        learner=LearnerSettings(model_dir=model_dir, lr=1e-4), slots_per_cell=size["slots"],
        async_rollout_cells=size["async_rollout"], work=work,
        harness=HarnessConfig(max_new_tokens=32, wall_clock_s=timeout, tool_timeout_s=timeout))


def calibrate(config, pool) -> dict:
    """A one-step colocated job on a different seed: the simulator's cost model, measured."""
    from ray_xlong.rllib.driver import run_job
    from ray_xlong.rllib.long_horizon_job import predicted_durations
    from ray_xlong.scheduling import SchedulingConfig

    job = SchedulingConfig(1, 1, config.job.runs_per_group, 0)
    work = dataclasses.replace(config.work, seed=config.work.seed + 10_000)
    cal = dataclasses.replace(config, job=job, work=work, mode="colocated")
    result = run_job(cal, pool)
    starts = {e.run: e.time for e in result.events if e.kind == "run_started"}
    took = {e.run: e.time - starts[e.run] for e in result.events if e.kind == "run_ended"}
    tool = predicted_durations(work, runs=job.total_runs, call_s=0.0, timeout_s=1e9)
    calls = predicted_durations(work, runs=1, call_s=1.0, timeout_s=1e9)[0] - tool[0]
    whole = [r for r in took if tool[r] < config.harness.wall_clock_s]  # not timed out
    per_call = [(took[r] - tool[r]) / calls for r in whole]
    t = result.timings
    return {
        "call_s": max(0.0, statistics.fmean(per_call)) if per_call else 0.0,
        "train_tokens_per_s": sum(t["micro_batch_targets"]) / sum(t["micro_batch_s"]),
        "tokens_per_run": sum(t["micro_batch_targets"]) / job.total_runs,
        "switch_s": statistics.fmean(t["switch_s"]),
        "sync_s": statistics.fmean(t["sync_s"]) if t.get("sync_s") else 0.0,
        "step_finish_s": statistics.fmean(t["step_finish_s"]),
    }


def sim_inputs(config, cal: dict):
    """Workload, cluster and costs of the job for the simulator (seconds as its hours)."""
    from ray_xlong.rllib.long_horizon_job import predicted_durations
    from ray_xlong.sim.cluster import ClusterConfig, CostConfig
    from ray_xlong.sim.workload import Workload

    n = config.job.total_runs
    durations = predicted_durations(config.work, runs=n, call_s=cal["call_s"],
                                    timeout_s=config.harness.wall_clock_s)
    workload = Workload(tuple(durations), (cal["tokens_per_run"],) * n, config.job.runs_per_group)
    lay = config.layout
    cluster = ClusterConfig(cells=lay.cells, nodes_per_cell=lay.nodes_per_cell,
                            gpus_per_node=lay.gpus_per_node, slots_per_cell=config.slots_per_cell)
    costs = CostConfig(train_tokens_per_cell_h=cal["train_tokens_per_s"],
                       step_fixed_h=cal["step_finish_s"], to_train_h=cal["switch_s"],
                       sync_h=cal["sync_s"])
    return workload, cluster, costs


def run_modes(config, pool, modes, cal: dict) -> tuple[dict, dict, float]:
    """Every mode on Ray and in the simulator; returns (rows, logs, lower bound)."""
    from ray_xlong.rllib.config import make_policy
    from ray_xlong.rllib.driver import run_job
    from ray_xlong.rllib.metrics import check_invariants
    from ray_xlong.sim.metrics import lower_bound_h
    from ray_xlong.sim.simulator import simulate

    workload, cluster, costs = sim_inputs(config, cal)
    lb = lower_bound_h(workload=workload, cluster=cluster, costs=costs, config=config.job)
    rows, logs = {}, {}
    for mode in modes:
        cfg = dataclasses.replace(config, mode=mode)
        real = run_job(cfg, pool)
        sim = simulate(make_policy(cfg), workload=workload, cluster=cluster, costs=costs,
                       config=cfg.job)
        t = real.timing_summary()
        rows[mode] = {
            "makespan_s": real.makespan_s, "sim_makespan_s": sim.makespan_h,
            "sim_vs_real": sim.makespan_h / real.makespan_s - 1.0,
            "gpu_busy_frac": real.gpu_busy_frac, "sim_gpu_busy_frac": 1.0 - sim.gpu_idle_frac,
            "over_lower_bound": real.makespan_s / lb,
            "switch_s_mean": t.get("switch_s_mean", 0.0), "switch_s_max": t.get("switch_s_max", 0.0),
            "sync_s_mean": t.get("sync_s_mean", 0.0), "sync_s_max": t.get("sync_s_max", 0.0),
            "step_finish_s_mean": t.get("step_finish_s_mean", 0.0),
            "role_switches": int(t.get("switch_s_count", 0) + t.get("sync_s_count", 0)),
            "staleness_max": max(real.staleness), "token_staleness_max": real.token_staleness_max,
            "violations": check_invariants(real, staleness_bound=cfg.job.staleness_bound),
            "placement_groups_created": real.placement_groups_created,
        }
        logs[mode] = (real.events, sim.events)
    for row in rows.values():
        base = rows.get("colocated", row)["makespan_s"]
        row["speedup_vs_colocated"] = base / row["makespan_s"]
    return rows, logs, lb


def table(rows: dict) -> str:
    """Markdown table of the mode rows."""
    head = ("| mode | makespan s | sim s | sim/real − 1 | × vs colocated | ÷ lower bound | "
            "GPU busy (sim) | switch ms mean/max | sync ms mean/max | step finish ms |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for mode, r in rows.items():
        lines.append(
            f"| {mode} | {r['makespan_s']:.2f} | {r['sim_makespan_s']:.2f} | "
            f"{r['sim_vs_real']:+.1%} | {r['speedup_vs_colocated']:.2f} | "
            f"{r['over_lower_bound']:.2f} | {r['gpu_busy_frac']:.2f} "
            f"({r['sim_gpu_busy_frac']:.2f}) | {1e3 * r['switch_s_mean']:.0f}/"
            f"{1e3 * r['switch_s_max']:.0f} | {1e3 * r['sync_s_mean']:.0f}/"
            f"{1e3 * r['sync_s_max']:.0f} | {1e3 * r['step_finish_s_mean']:.0f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="reduced workload (about a minute)")
    p.add_argument("--smoke", action="store_true", help="tiny budget (CI)")
    p.add_argument("--modes", nargs="+", default=list(MODES))
    p.add_argument("--json", type=pathlib.Path)
    p.add_argument("--plot-dir", type=pathlib.Path)
    args = p.parse_args(argv)
    size_name = "smoke" if args.smoke else "quick" if args.quick else "full"
    size = SIZES[size_name]

    import ray

    from ray_xlong.models import build_tiny_model_dir
    from ray_xlong.rllib.driver import start_cells
    from ray_xlong.sim.timeline import plot_timelines

    tmp = tempfile.mkdtemp(prefix="rx", dir="/tmp")
    os.environ.setdefault("RAY_TMPDIR", tmp)
    t0 = time.perf_counter()
    ray.init(num_cpus=size["cells"], num_gpus=size["cells"], include_dashboard=False,
             log_to_driver=False)
    try:
        config = build_config(size, model_dir=str(build_tiny_model_dir(f"{tmp}/m", seed=0)),
                              seed=args.seed)
        pool = start_cells(config)
        cal = calibrate(config, pool)
        rows, logs, lb = run_modes(config, pool, args.modes, cal)
        pool.shutdown()
    finally:
        ray.shutdown()
    out = {"seed": args.seed, "size": size_name, "job": dataclasses.asdict(config.job),
           "cells": size["cells"], "slots_per_cell": size["slots"], "lower_bound_s": lb,
           "calibration": cal, "cells_startup_s": pool.startup_s,
           "wall_s": time.perf_counter() - t0, "modes": rows}
    print(f"modes_ray ({size_name}, seed {args.seed}): {size['cells']} cells, job "
          f"{config.job}, lower bound {lb:.2f} s, cells up in {pool.startup_s:.1f} s")
    print(table(rows))
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))
    if args.plot_dir:
        args.plot_dir.mkdir(parents=True, exist_ok=True)
        for mode, (real, sim) in logs.items():
            plot_timelines({f"{mode} (ray)": real, f"{mode} (sim)": sim},
                           str(args.plot_dir / f"modes_ray_{mode}.png"),
                           title=f"{mode}: Ray cells vs simulator", time_unit="seconds")
    return out


if __name__ == "__main__":
    main()
