"""Chaos benchmark: a random fault of a random kind every ~30-60 s for M minutes while an elastic
job learns the lookup task on a multi-node ``ray.cluster_utils`` cluster; counts what was lost.

    python benchmarks/chaos.py --minutes 20 --seed 0 [--json out/chaos.json]
    python benchmarks/chaos.py --smoke --json out/chaos_smoke.json      # 45 s, 8-14 s (CI)
    python benchmarks/chaos.py --minutes 5 --step-s 1.5 --policy-seed 1 --workdir .cache/rx

The job (elastic, ``--cells`` cells, one worker node each, a head node without GPUs for the
driver; the warm-started tiny policy of the local RL recipe, ``--groups`` × ``--runs-per-group``
runs per step, Adam at ``--lr``, checkpoints every ``--checkpoint-every`` steps and a run
spool) runs in a driver process (``python -m benchmarks.tools.faults --chaos``). Its length is
set to last about M minutes (``--step-s``: the expected seconds per step), and the driver paces
it so that it does not end before the fault window does (a fast machine would otherwise
finish the job before its last faults: ``ChaosInjector``). The schedule: from
the first checkpoint on, every uniform(``--gap-min``, ``--gap-max``) seconds until M minutes are
over, one fault of a seeded random kind (``--kinds``):

    runner    a runner actor killed (``ray.kill``), by the driver process when due
    learner   a Learner actor killed (a step member mid micro-batch when there is one)
    node      a cell's worker node removed (``Cluster.remove_node``), a like one added back
              after ``--node-down-s``; never the last node standing
    driver    the driver process SIGKILLed; a new one resumes from the last checkpoint

Audit over the whole job, every driver included (``benchmarks.tools.faults.audit``): runs lost
(goal 0), runs trained twice (goal 0), versions consistent; the reward trend from the reward of
every trained run (mean of the first and last quarter of the steps, least-squares slope per
step; goal: rising); faults injected by kind and the recovery records of the job. JSON::

    {"minutes": M, "seed": S, "steps": n, "job_s": x, "runs_lost": 0, "runs_trained_twice": 0,
     "audit_ok": true, "faults_injected": {"runner": n, …}, "recoveries": {"runner": n, …},
     "reward_first": r, "reward_last": r, "reward_slope": s, "reward_rising": true,
     "rewards": [per-step mean], "driver_restarts": n, "config": {…}}
"""

from __future__ import annotations

import collections
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
CHAOS_LR = 2e-4
"""The job's Adam learning rate: the local RL recipe's 5e-4 is tuned for runs of tens of steps;
over hundreds of steps at a saturated reward it collapses the policy now and then, faults or
not (one fault-free 400-step run fell from 0.93 to 0 at step 101), and a policy whose groups all
score 0 has no learning signal left. 2e-4 held over 400 fault-free steps and a faulted run."""


def make_config(root: str, workdir: str, *, cells: int, steps: int, seed: int, groups: int,
                runs_per_group: int, checkpoint_every: int, policy_seed: int = 1,
                lr: float | None = None):
    """The elastic job on the warm-started lookup policy (the local RL recipe) at Adam
    learning rate ``lr`` (None: :data:`CHAOS_LR`)."""
    from ray_xlong.cells.config import CellJobConfig, LearnerSettings
    from ray_xlong.cells.layout import CellLayout
    from ray_xlong.cells.task_job import TaskJob, warm_started_model_dir
    from ray_xlong.rllib.options import RECIPE_HARNESS
    from ray_xlong.scheduling import SchedulingConfig

    model_dir = warm_started_model_dir(workdir, seed=policy_seed)
    job = SchedulingConfig(total_steps=steps, batch_groups=groups, runs_per_group=runs_per_group,
                           staleness_bound=1)
    return CellJobConfig(
        mode="elastic", job=job,
        layout=CellLayout(cells=cells, nodes_per_cell=1, gpus_per_node=1, cpus_per_bundle=1.0),
        learner=LearnerSettings(model_dir=str(model_dir), lr=CHAOS_LR if lr is None else lr),
        slots_per_cell=4,
        work=TaskJob("lookup", seed=seed), harness=RECIPE_HARNESS,
        spool_dir=os.path.join(root, "spool"), checkpoint_dir=os.path.join(root, "ckpt"),
        checkpoint_every=checkpoint_every)


def schedule(rng: random.Random, *, start: float, minutes: float, gap: tuple[float, float],
             kinds: list[str]):
    """Fault times from ``start`` (unix seconds) until ``minutes`` are over."""
    from benchmarks.tools.faults import ChaosFault

    out, t = [], start
    while True:
        t += rng.uniform(*gap)
        if t > start + minutes * 60:
            return out
        out.append(ChaosFault(t, rng.choice(kinds), len(out)))


def trend(rewards: list[float]) -> dict:
    """First / last quarter means and the least-squares slope per step."""
    n = len(rewards)
    if n < 2:
        return {"reward_first": None, "reward_last": None, "reward_slope": None,
                "reward_rising": False}
    q = max(1, n // 4)
    first, last = sum(rewards[:q]) / q, sum(rewards[-q:]) / q
    xm, ym = (n - 1) / 2, sum(rewards) / n
    slope = (sum((i - xm) * (r - ym) for i, r in enumerate(rewards))
             / sum((i - xm) ** 2 for i in range(n)))
    return {"reward_first": round(first, 4), "reward_last": round(last, 4),
            "reward_slope": round(slope, 5), "reward_rising": last > first and slope > 0}


def run(args) -> dict:
    from benchmarks.faults import LocalCluster
    from benchmarks.tools.faults import audit, trained_checkpoint
    from ray_xlong.cells.checkpoint import CHECKPOINT

    root = tempfile.mkdtemp(prefix="rxc", dir="/tmp")
    os.environ.setdefault("RAY_TMPDIR", root)
    steps = max(4, math.ceil(args.minutes * 60 / args.step_s))
    config = make_config(root, args.workdir or os.path.join(root, "work"), cells=args.cells,
                         steps=steps, seed=args.seed, groups=args.groups,
                         runs_per_group=args.runs_per_group,
                         checkpoint_every=args.checkpoint_every, policy_seed=args.policy_seed,
                         lr=args.lr)
    kinds = [k for k in args.kinds.split(",") if k]
    import benchmarks.faults as bf

    # a removed node is found in ~30 s; the faults benchmark's ~2 s marks busy nodes dead
    # under a heavy load
    bf.HEALTH = {**bf.HEALTH, "health_check_period_ms": 1000, "health_check_timeout_ms": 2000,
                 "health_check_failure_threshold": 30}
    cluster = LocalCluster(args.cells)
    cfg_path, out = os.path.join(root, "config.pkl"), os.path.join(root, "result.pkl")
    fired = os.path.join(root, "fired.txt")
    with open(cfg_path, "wb") as f:
        pickle.dump(config, f)
    rng = random.Random(args.seed)
    cmd = [sys.executable, "-m", "benchmarks.tools.faults", "--config", cfg_path,
           "--address", cluster.address, "--out", out, "--chaos", os.path.join(root, "chaos.pkl")]
    settings = os.path.join(root, "chaos.pkl")
    rewards_path = settings + ".rewards"
    logs = open(os.path.join(root, "drivers.log"), "ab")
    injected: collections.Counter = collections.Counter()
    restarts, crashes, down = 0, 0, []
    t0 = time.time()
    driver = subprocess.Popen(cmd, cwd=ROOT, stdout=logs, stderr=logs)
    ckpt_dir = config.checkpoint_dir
    ckpt = os.path.join(ckpt_dir, CHECKPOINT)
    plan = None
    try:
        while True:
            if driver.poll() is not None:
                if driver.returncode == 0:
                    break
                if not os.path.exists(ckpt) or crashes >= args.max_driver_crashes:
                    raise RuntimeError(f"driver exited with {driver.returncode} (see "
                                       f"{root}/drivers.log)")
                # a driver that failed on its own (e.g. a node removed while it created its
                # cells): started again from the last checkpoint, counted apart from faults
                crashes += 1
                driver = subprocess.Popen(cmd + ["--resume"], cwd=ROOT, stdout=logs, stderr=logs)
            now = time.time()
            if plan is None and trained_checkpoint(ckpt_dir):   # faults start at the first
                # checkpoint of a trained version (the job's start is checkpointed too)
                plan = collections.deque(schedule(rng, start=now, minutes=args.minutes,
                                                  gap=(args.gap_min, args.gap_max), kinds=kinds))
                tmp = settings + ".tmp"
                with open(tmp, "wb") as f:
                    # the driver paces the job to end no earlier than the window (+ 5 s)
                    pickle.dump({"schedule": list(plan), "seed": args.seed, "fired": fired,
                                 "until": now + args.minutes * 60 + 5.0}, f)
                os.replace(tmp, settings)          # the driver process reads it on its next tick
            for due, token in list(down):
                if now >= due:
                    cluster.restore_node(token)
                    down.remove((due, token))
            while plan and plan[0].at <= now:
                fault = plan[0]
                if fault.kind == "driver":
                    driver.send_signal(signal.SIGKILL)
                    driver.wait()
                    driver = subprocess.Popen(cmd + ["--resume"], cwd=ROOT, stdout=logs,
                                              stderr=logs)
                    restarts += 1
                    injected["driver"] += 1
                elif fault.kind == "node":
                    if down or not _remove_a_node(cluster, rng, down, args.node_down_s):
                        break                       # one node down at a time: later
                    injected["node"] += 1
                plan.popleft()                      # runner / learner: the driver fires them
            time.sleep(0.5)
    finally:
        for _, token in down:
            cluster.restore_node(token)
        if driver.poll() is None:
            driver.kill()
        cluster.shutdown()
    job_s = time.time() - t0
    with open(out, "rb") as f:
        result = pickle.load(f)["result"]
    if os.path.exists(fired):
        with open(fired) as f:
            injected.update(line.split()[1] for line in f if line.strip())
    rewards = {}
    if os.path.exists(rewards_path):
        with open(rewards_path) as f:
            rewards = {r: float(v) for r, v in (line.split() for line in f if line.strip())}
    per_step = [sum(rewards[r] for r in ids if r in rewards) / max(1, sum(r in rewards
                                                                         for r in ids))
                for ids in result.trained_runs]
    a = audit(result, config.job)
    recoveries = collections.Counter(f.kind for f in result.faults)
    return {"minutes": args.minutes, "seed": args.seed, "steps": a.steps, "job_s": round(job_s, 1),
            "runs_lost": a.runs_lost, "runs_trained_twice": a.runs_trained_twice,
            "runs_rerun": a.runs_rerun, "audit_ok": a.ok,
            "versions_consistent": a.versions_consistent, "violations": list(a.violations)[:5],
            "faults_injected": {k: injected.get(k, 0) for k in kinds},
            "faults_total": sum(injected.values()), "recoveries": dict(recoveries),
            "driver_restarts": restarts, "driver_crashes": crashes, **trend(per_step),
            "rewards": [round(r, 4) for r in per_step],
            "config": {k: v for k, v in vars(args).items() if k != "json"},
            "total_steps": steps, "runs_per_step": args.groups * args.runs_per_group}


def show(r: dict) -> None:
    print(f"chaos {r['minutes']} min, seed {r['seed']}: {r['steps']} steps in {r['job_s']} s; "
          f"faults {r['faults_total']} {r['faults_injected']}; recoveries {r['recoveries']}")
    print("| runs lost | trained twice | re-run | reward first ¼ | reward last ¼ | slope/step | "
          "audit |")
    print("|---|---|---|---|---|---|---|")
    print(f"| {r['runs_lost']} | {r['runs_trained_twice']} | {r['runs_rerun']} | "
          f"{r['reward_first']} | {r['reward_last']} | {r['reward_slope']} | "
          f"{'ok' if r['audit_ok'] else 'FAILED'} |")


def _remove_a_node(cluster, rng: random.Random, down: list, node_down_s: float) -> bool:
    """Remove one live worker node (never the last); note when to add one back."""
    workers = [n for n in cluster.cluster.list_all_nodes() if n is not cluster.cluster.head_node]
    if len(workers) < 2:
        return False
    node = rng.choice(workers)
    token = cluster.remove_node(node.node_id)
    if token is None:
        return False
    down.append((time.time() + node_down_s, token))
    return True


def main(argv: list[str] | None = None) -> int:
    p = bench_parser(__doc__)
    p.add_argument("--minutes", type=float, default=20.0, help="how long faults are injected")
    p.add_argument("--kinds", default=",".join(KINDS), help=f"fault kinds among {KINDS}")
    p.add_argument("--gap-min", type=float, default=30.0, help="seconds between faults, least")
    p.add_argument("--gap-max", type=float, default=60.0, help="seconds between faults, most")
    p.add_argument("--cells", type=int, default=3, help="cells (one worker node each)")
    p.add_argument("--groups", type=int, default=4, help="groups per step")
    p.add_argument("--runs-per-group", type=int, default=4)
    p.add_argument("--checkpoint-every", type=int, default=2, help="steps between checkpoints")
    p.add_argument("--step-s", type=float, default=3.0,
                   help="expected seconds per step (sets the job's length to ~M minutes)")
    p.add_argument("--node-down-s", type=float, default=5.0)
    p.add_argument("--max-driver-crashes", type=int, default=10,
                   help="drivers that fail on their own restarted from the checkpoint at most")
    p.add_argument("--workdir", default=None, help="warm-started policy cache")
    p.add_argument("--policy-seed", type=int, default=1,
                   help="seed of the warm-started policy (--seed: the faults and the tasks)")
    p.add_argument("--lr", type=float, default=CHAOS_LR, help="the Learner's Adam learning rate")
    args = p.parse_args(argv)
    if args.smoke:             # CI: 45 s of faults 8-14 s apart, a 36-step job (paced: every
        # fault falls inside the job on a fast machine; a slow one does not train on for
        # minutes after the window)
        args.minutes, args.step_s, args.gap_min, args.gap_max = 0.75, 1.25, 8.0, 14.0
    bad = set(args.kinds.split(",")) - set(KINDS)
    if bad or args.cells < 2 or not 0 < args.gap_min <= args.gap_max or args.minutes <= 0:
        p.error(f"--kinds among {KINDS} (got {sorted(bad)}), --cells >= 2, "
                f"0 < --gap-min <= --gap-max, --minutes > 0")
    result = finish(run(args), show=show, json_path=args.json)
    return 0 if result["audit_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
