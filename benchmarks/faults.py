"""Fault benchmark (and the fault suite's engine): kill things during elastic jobs on a
multi-node ``ray.cluster_utils`` cluster and count what was lost.

    python benchmarks/faults.py [--kinds runner,learner,node,driver] [--per-kind 2] [--seed 0]
                                [--steps 4] [--cells 3] [--ranks-per-cell 1] [--together]
                                [--json PATH]

One job per fault kind, on a fresh pool of cells (one worker node per cell, a head node without
GPUs for the driver); ``--together``: the runner, learner and node faults go into one job (their
rows still count each kind's injections, detections and recovery times; CI's smoke run, one
pool start instead of three). ``runner`` / ``learner`` kill actors (``ray.kill``) when a seeded
fraction of the job's runs has ended; ``node`` removes a cell's node (``Cluster.remove_node``)
and adds a node like it back after a few seconds; ``driver`` runs the job in a driver process
(``python -m benchmarks.tools.faults``), kills it (SIGKILL) after its first checkpoint plus a
seeded delay, and resumes it in a new driver process. Each job is audited from its event log
and trained-run ids (``benchmarks.tools.faults.audit``): runs lost (goal 0), runs trained twice
(goal 0), runs re-run, versions consistent, cell invariants. ``--ranks-per-cell 2``: every
cell's Learner is 2 FSDP2 ranks (gloo) on its node, and a ``learner`` fault kills one rank in
the middle of a sharded step (the cell's share is redone elsewhere).

Table columns: injected, survived (faults after which the job still finished with a clean
audit), runs lost, runs trained twice, runs re-run, recover_s (mean seconds from the kill to the
cell working again, or to the new driver having resumed). JSON::

    {"faults": [{"kind": ..., "injected": n, "survived": n, "runs_lost": n,
                 "runs_trained_twice": n, "runs_rerun": n, "recover_s": x, "audit_ok": bool,
                 "steps": n, "job_s": x}], "config": {...}}
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import pathlib
import pickle
import random
import signal
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # benchmarks.tools
from benchmarks.tools.entry import bench_parser, finish  # noqa: E402

KINDS = ("runner", "learner", "node", "driver")
HEALTH = {"health_check_initial_delay_ms": 0, "health_check_period_ms": 500,
          "health_check_timeout_ms": 500, "health_check_failure_threshold": 3}
"""Detect a removed node in ~2 s instead of ~15 s (Ray's defaults are for real networks)."""


def make_config(root: str, *, cells: int, steps: int, seed: int, ranks_per_cell: int = 1):
    from ray_xlong.models import build_tiny_model_dir
    from ray_xlong.cells.layout import CellLayout
    from ray_xlong.cells.config import CellJobConfig
    from ray_xlong.cells.config import LearnerSettings
    from ray_xlong.cells.long_horizon_job import LongHorizonJob
    from ray_xlong.cells.sharding import ShardingSettings
    from ray_xlong.rollout import HarnessConfig
    from ray_xlong.rollout.tasks import LongHorizonConfig
    from ray_xlong.scheduling import SchedulingConfig

    model_dir = os.path.join(root, "model")
    if not os.path.exists(os.path.join(model_dir, "config.json")):
        build_tiny_model_dir(model_dir, seed=0)
    job = SchedulingConfig(total_steps=steps, batch_groups=2, runs_per_group=2,
                           staleness_bound=1)
    work = LongHorizonJob(task=LongHorizonConfig(num_steps=4, latency_median_s=900.0,
                                                 latency_sigma=0.8, time_scale=1 / 3600),
                          seed=seed)
    return CellJobConfig(
        mode="elastic", job=job,
        layout=CellLayout(cells=cells, nodes_per_cell=1, gpus_per_node=1, cpus_per_bundle=1.0),
        learner=LearnerSettings(model_dir=str(model_dir), lr=1e-4), slots_per_cell=2,
        work=work, harness=HarnessConfig(max_new_tokens=32, wall_clock_s=2.5, tool_timeout_s=2.5),
        spool_dir=os.path.join(root, "spool"),
        # a survivor's collective gives up after timeout_s (the cell is replaced before that)
        sharding=ShardingSettings(ranks_per_cell=ranks_per_cell, timeout_s=30.0))


class LocalCluster:
    """A ``cluster_utils`` cluster: a head (driver, no GPUs) and one worker node per cell."""

    def __init__(self, cells: int) -> None:
        import ray
        from ray.cluster_utils import Cluster

        self.cluster = Cluster(initialize_head=True, head_node_args={
            "num_cpus": 1, "num_gpus": 0, "_system_config": HEALTH})
        for _ in range(cells):
            self.cluster.add_node(num_cpus=1, num_gpus=1)
        ray.init(address=self.cluster.address, include_dashboard=False, log_to_driver=False)
        self.cluster.wait_for_nodes()
        self.address = self.cluster.address

    def remove_node(self, node_id: str):
        """Remove that worker node; None when it is not (or no longer) one of ours."""
        node = next((n for n in self.cluster.list_all_nodes() if n.node_id == node_id), None)
        if node is None or node is self.cluster.head_node:
            return None
        self.cluster.remove_node(node, allow_graceful=False)
        return {"num_cpus": 1, "num_gpus": 1}

    def restore_node(self, args) -> None:
        self.cluster.add_node(wait=False, **args)

    def shutdown(self) -> None:
        import ray

        ray.shutdown()
        self.cluster.shutdown()


def run_in_driver(kinds: tuple[str, ...], config, cluster: LocalCluster, *, per_kind: int,
                  seed: int) -> list[dict]:
    """One job with ``per_kind`` faults of each of ``kinds`` injected by this (the driver)
    process; one row per kind."""
    from ray_xlong.cells.actuator import RayActuator
    from ray_xlong.cells.config import make_policy
    from ray_xlong.jobs.driver import start_cells
    from benchmarks.tools.faults import FaultInjector, FaultPlan, audit

    # Checkpoints every step, as a job that must survive a node needs: a step trained by one
    # cell leaves the new state on that cell's node only, and a node fault there leaves the
    # last checkpoint + the spool as the only way back to it.
    config = dataclasses.replace(config, checkpoint_every=1, checkpoint_dir=os.path.join(
        os.path.dirname(config.spool_dir), f"ckpt-{'-'.join(kinds)}"))
    pool = start_cells(config)
    act = RayActuator(config, make_policy(config), pool)
    plan = FaultPlan(seed=seed, **{kind: per_kind for kind in kinds})
    act.injector = FaultInjector(plan, config.job, remove_node=cluster.remove_node,
                                 restore_node=cluster.restore_node)
    t = time.perf_counter()
    try:
        result = act.run()
    finally:
        act.injector.finish()
    job_s = time.perf_counter() - t
    pool.shutdown()
    a = audit(result, config.job)
    rows = []
    for kind in kinds:
        # Recovery time: from each kill of this kind to the end of the recovery that followed
        # it (for a node: to the cell's retirement, when the job goes on without it;
        # rebuild_s: to its rebuild).
        kills = [f.t for f in act.injector.log if f.kind == kind]
        gaps = _gaps(kills, result.faults, KIND_RECORDS[kind])
        out = row(kind, act.injector.injected[kind], a, gaps, job_s, result.faults,
                  detected=sum(1 for f in result.faults if f.kind in KIND_RECORDS[kind]))
        out["ranks_killed"] = [f.rank for f in act.injector.log
                               if f.kind == kind and f.rank is not None]
        if kind == "node":
            rebuild = _gaps(kills, result.faults, ("node_returned",))
            out["rebuild_s"] = _mean_s(rebuild)
            out["rebuilt"] = sum(not math.isnan(g) for g in rebuild)
        rows.append(out)
    return rows


def _gaps(kills: list[float], records, kinds: tuple[str, ...]) -> list[float]:
    """Seconds from each kill to the end of the first recovery of ``kinds`` after it."""
    done = sorted(f.t + f.recover_s for f in records if f.kind in kinds)
    return [next((d - k for d in done if d >= k), float("nan")) for k in kills]


def _mean_s(gaps: list[float]) -> float | None:
    """Mean of the gaps that ended (not NaN), rounded to ms; None when none did."""
    finite = [g for g in gaps if not math.isnan(g)]
    return round(sum(finite) / len(finite), 3) if finite else None


def run_driver_restart(config, cluster: LocalCluster, root: str, *, seed: int) -> dict:
    """Run the job in a driver process, SIGKILL it after its first checkpoint of a trained
    version, resume it."""
    from benchmarks.tools.faults import audit, trained_checkpoint

    os.makedirs(root, exist_ok=True)
    config = dataclasses.replace(config, checkpoint_dir=os.path.join(root, "ckpt"),
                                 spool_dir=os.path.join(root, "spool"))
    cfg_path, out = os.path.join(root, "config.pkl"), os.path.join(root, "result.pkl")
    with open(cfg_path, "wb") as f:
        pickle.dump(config, f)
    cmd = [sys.executable, "-m", "benchmarks.tools.faults", "--config", cfg_path,
           "--address", cluster.address, "--out", out]
    t = time.perf_counter()
    first = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    while not trained_checkpoint(config.checkpoint_dir):
        if first.poll() is not None:
            raise RuntimeError(f"driver exited ({first.returncode}) before its first checkpoint")
        time.sleep(0.2)
    time.sleep(random.Random(seed).uniform(0.5, 3.0))
    injected = 0
    if first.poll() is None:
        first.send_signal(signal.SIGKILL)
        first.wait()
        injected = 1
    killed_at = time.time()
    subprocess.run(cmd + ["--resume"], check=True, cwd=ROOT, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL, timeout=900)
    job_s = time.perf_counter() - t
    with open(out, "rb") as f:
        got = pickle.load(f)
    result = got["result"]
    a = audit(result, config.job)
    gaps = [got["resumed_at"] - killed_at] if injected else []
    return row("driver", injected, a, gaps, job_s, result.faults)


KIND_RECORDS = {"runner": ("runner", "both"), "learner": ("learner", "both"),
                "node": ("node",), "driver": ("driver",)}
"""Recovery records (``RayResult.faults`` kinds) that answer each injected fault kind."""


def row(kind: str, injected: int, a, gaps: list[float], job_s: float, records, *,
        detected: int | None = None) -> dict:
    detected = injected if detected is None else detected
    return {"kind": kind, "injected": injected,
            "survived": min(injected, detected) if a.ok else 0, "detected": detected,
            "runs_lost": a.runs_lost, "runs_trained_twice": a.runs_trained_twice,
            "runs_rerun": a.runs_rerun,
            "recover_s": _mean_s(gaps),
            "audit_ok": a.ok, "steps": a.steps, "versions_consistent": a.versions_consistent,
            "violations": list(a.violations)[:5], "job_s": round(job_s, 2),
            "micro_batches_redone": sum(r.micro_batches_redone for r in records),
            "runs_from_spool": sum(r.runs_from_spool for r in records)}


def main(argv: list[str] | None = None) -> int:
    p = bench_parser("Inject faults into elastic jobs on a local multi-node Ray cluster and "
                     "count what was lost.", smoke=False)
    p.add_argument("--kinds", default=",".join(KINDS),
                   help=f"comma-separated fault kinds among {KINDS}")
    p.add_argument("--per-kind", type=int, default=2,
                   help="faults per job (runner / learner / node; driver is always 1)")
    p.add_argument("--steps", type=int, default=4, help="optimizer steps per job")
    p.add_argument("--cells", type=int, default=3, help="cells (one worker node each)")
    p.add_argument("--ranks-per-cell", type=int, default=1,
                   help="Learner ranks per cell (FSDP2, gloo; a learner fault kills one rank)")
    p.add_argument("--together", action="store_true",
                   help="inject the runner, learner and node faults into one job (rows per kind "
                        "as before; the driver restart stays a job of its own)")
    args = p.parse_args(argv)
    kinds = [k for k in args.kinds.split(",") if k]
    bad = set(kinds) - set(KINDS)
    if bad or args.per_kind < 1 or args.cells < 2 or args.ranks_per_cell < 1:
        p.error(f"--kinds must be among {KINDS} (got {sorted(bad)}), --per-kind >= 1, "
                f"--cells >= 2, --ranks-per-cell >= 1")
    root = tempfile.mkdtemp(prefix="rxf", dir="/tmp")
    os.environ.setdefault("RAY_TMPDIR", root)
    config = make_config(root, cells=args.cells, steps=args.steps, seed=args.seed,
                         ranks_per_cell=args.ranks_per_cell)
    cluster = LocalCluster(args.cells)
    # the jobs: the driver restart alone (its own driver process); the in-driver kinds one job
    # each, or all in one job (--together)
    in_driver = [k for k in kinds if k != "driver"]
    if args.together:
        jobs = (([tuple(in_driver)] if in_driver else [])
                + ([("driver",)] if "driver" in kinds else []))
    else:
        jobs = [(k,) for k in kinds]
    rows = []
    try:
        for i, job in enumerate(jobs):
            if job == ("driver",):
                got = [run_driver_restart(config, cluster, os.path.join(root, "drv"),
                                          seed=args.seed + i)]
            else:
                got = run_in_driver(job, config, cluster, per_kind=args.per_kind,
                                    seed=args.seed + i)
            for r in got:
                print(f"{r['kind']}: {json.dumps(r)}", flush=True)
            rows += got
    finally:
        cluster.shutdown()
    print(f"\n{'fault':<8} {'injected':>8} {'survived':>8} {'lost':>5} {'twice':>5} "
          f"{'re-run':>6} {'recover_s':>9} {'job_s':>7}")
    for r in rows:
        rec = "-" if r["recover_s"] is None else f"{r['recover_s']:.2f}"
        print(f"{r['kind']:<8} {r['injected']:>8} {r['survived']:>8} {r['runs_lost']:>5} "
              f"{r['runs_trained_twice']:>5} {r['runs_rerun']:>6} {rec:>9} {r['job_s']:>7.1f}")
    finish({"faults": rows, "config": vars(args)}, show=lambda _: None, json_path=args.json)
    return 0 if all(r["audit_ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
