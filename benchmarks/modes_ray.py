"""The three modes on real Ray cells, side by side with the simulator on the same workload.

    python benchmarks/modes_ray.py --seed 0 [--quick | --smoke | --size paper8] \
        [--json out.json] [--plot-dir plots/] [--address auto] [--ranks-per-cell 2]

``--size paper8``: 8 cells on one machine (logical GPUs), the paper-2.4t run-length
distribution compressed from hours to seconds (median 5 s, 61% of runs >= 4 s, cut at 6 s),
16 steps, light runners (no model: the oracle's tokens are not scored); modes colocated, async,
elastic, forecast (sized by the calibration), forecast_online (its inputs learned from the job's
own events), best_static (async with the split the simulator finds best for the
calibrated workload) and planned (``ray_xlong/sim/planner.py``: plans with the simulator on the
driver, from job start with the calibration as its prior, then from the live state as its
estimates move; its row lists the plans and their driver seconds); ``--quick`` runs colocated, async,
elastic and planned; the calibration also measures how many of the 8 logical GPUs train at
full speed at once on this machine's shared cores (``parallel_training_cells``).

One Ray instance (embedded with logical GPUs, keeping idle task workers:
``mode_bench.KEEP_TASK_WORKERS``; or ``--address`` of a cluster); placement groups created once; every mode runs the same seeded long-horizon job (time-compressed: one task hour
is one wall second) on the same cells. A calibration job first measures the cost model
(per-call overhead, training tokens/s, switch, sync, step finish); the simulator then runs every
mode on the predicted workload of the same job, its step finish blocking the actuator as it
blocks the Ray driver (``CostConfig.finish_blocks``). The logic lives in
``ray_xlong.jobs.mode_bench`` (also behind ``ray-xlong bench --backend ray``). Prints a
markdown table and writes JSON shaped ``{"modes": {mode: {"makespan_s", "sim_makespan_s",
"vs_elastic", "gpu_busy_frac", ...}}, "lower_bound_s", "calibration", ...}`` and one timeline
PNG per mode (Ray above, simulator below: one plotting function for both logs).
``--ranks-per-cell 2``: every training cell's Learner is 2 FSDP2 ranks (gloo on CPU).
"""

from __future__ import annotations

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # benchmarks.tools
from benchmarks.tools.entry import bench_parser, finish  # noqa: E402
from ray_xlong.jobs.mode_bench import (MODES, PAPER8_MODES, QUICK_MODES, SIZES,  # noqa: E402
                                       run_comparison, table)

__all__ = ["MODES", "PAPER8_MODES", "QUICK_MODES", "SIZES", "main"]


def main(argv: list[str] | None = None) -> dict:
    p = bench_parser(__doc__)
    p.add_argument("--quick", action="store_true", help="reduced workload (about a minute)")
    p.add_argument("--size", choices=sorted(SIZES), default=None,
                   help="job size (overrides --quick / --smoke); paper8 = the paper's shape")
    p.add_argument("--modes", nargs="+", default=None,
                   help=f"default {' '.join(QUICK_MODES)} ({' '.join(PAPER8_MODES)} for paper8)")
    p.add_argument("--address", default=None, help="Ray cluster to join (e.g. auto)")
    p.add_argument("--ranks-per-cell", type=int, default=1,
                   help="Learner ranks per training cell (FSDP2; gloo on CPU)")
    p.add_argument("--plot-dir", type=pathlib.Path)
    args = p.parse_args(argv)
    size_name = args.size or ("smoke" if args.smoke else "quick" if args.quick else "full")
    modes = args.modes or list(PAPER8_MODES if size_name == "paper8" else QUICK_MODES)

    from ray_xlong.sim.timeline import plot_timelines

    if args.ranks_per_cell < 1:
        p.error("--ranks-per-cell must be >= 1")
    run = run_comparison(size=size_name, seed=args.seed, modes=modes, address=args.address,
                         ranks_per_cell=args.ranks_per_cell)
    out = run.summary
    print(f"modes_ray ({size_name}, seed {args.seed}): {out['cells']} cells, job {out['job']}, "
          f"lower bound {out['lower_bound_s']:.2f} s, cells up in {out['cells_startup_s']:.1f} s")
    print(table(out["modes"]))
    print("calibration: " + ", ".join(f"{k} {v:.4g}" for k, v in out["calibration"].items()))
    if "best_static" in out["modes"]:
        split = out["modes"]["best_static"]["split"]
        print(f"best_static split: {split['rollout_cells']} rollout / "
              f"{split['training_cells']} training cells")
    finish(out, show=lambda _: None, json_path=args.json)     # the tables are printed above
    if args.plot_dir:
        args.plot_dir.mkdir(parents=True, exist_ok=True)
        for mode, (real, sim) in run.logs.items():
            plot_timelines({f"{mode} (ray)": real, f"{mode} (sim)": sim},
                           str(args.plot_dir / f"modes_ray_{mode}.png"),
                           title=f"{mode}: Ray cells vs simulator", time_unit="seconds")
    return out


if __name__ == "__main__":
    main()
