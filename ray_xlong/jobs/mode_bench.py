"""The mode comparison on real Ray cells, side by side with the simulator on the same workload.

Shared by ``benchmarks/modes_ray.py`` and ``ray-xlong bench --backend ray``::

    connect (ray.init(address=...) or an embedded local Ray with logical GPUs)
    pool = start_cells(config)                  placement groups created once, every mode reuses
    cal = calibrate(config, pool)               one-step colocated job → the simulator's costs
    for mode: RayActuator(mode's policy).run()  the real job          → RayResult
              simulate(same policy, workload)   the predicted job     → SimResult
    rows (makespans, ratios, switch / sync costs, invariant violations), event logs

Every mode runs the same seeded long-horizon job (time-compressed: one task hour is one wall
second), so the simulator reads the Ray seconds as its hours. Ratios: ``vs_elastic`` =
makespan ÷ elastic's makespan (< 1 is faster than elastic), ``speedup_vs_colocated`` =
colocated ÷ makespan. ``forecast`` (our mode) is sized from the calibration: a training cell
trains ``train_tokens_per_s / tokens_per_run / runs_per_group`` groups per second, and the
forecast horizon is the run timeout.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import tempfile
import time
from typing import Callable

from ray_xlong.scheduling.modes import ALL_MODES, ModeInputs, make_policy  # the one registry
from ray_xlong.scheduling.modes import PAPER_MODES as MODES
from ray_xlong.sim.planner import PlanCosts, planned_policy

PAPER8_MODES = ("colocated", "async", "elastic", "forecast", "forecast_online", "best_static",
                "planned")
"""The modes ``--size paper8`` runs (``best_static``: async with the split the simulator finds
best for the calibrated workload, hindsight over every split: :func:`best_static_rollout_cells`;
``forecast`` sized by the calibration, ``forecast_online`` learning the same inputs from the
job's own events; ``planned``: ``sim.planner``)."""
QUICK_MODES = MODES + ("planned",)
"""The modes ``--quick`` (and the other small sizes) run by default."""

PLAN_WALL_BUDGET = 0.02
"""The planned policy's re-plans may pause the driver for at most this share of the job's wall
time (its first plan, from the calibration, is made before the job starts: ``prepare``). On
paper8, with no limit, 9 plans of 0.2–1 s each (load 15–50) made it 3.8 s slower than
forecast, which it followed (``PlanCosts.wall_budget``)."""

SIZES = {  # cells, steps, groups/step, runs/group, slots, async rollout cells, task steps,
    # median tool latency (task seconds; 3600 = one wall second)
    "smoke": dict(cells=2, steps=2, batch=2, group=2, slots=2, async_rollout=1, task_steps=3,
                  median_s=720.0),
    "quick": dict(cells=3, steps=3, batch=3, group=2, slots=2, async_rollout=2, task_steps=4,
                  median_s=2160.0, cal_steps=3),
    "full": dict(cells=4, steps=6, batch=4, group=2, slots=3, async_rollout=3, task_steps=6,
                 median_s=2160.0),
    # paper-2.4t compressed (one task hour = one wall second): 8 cells, a run's tool time is
    # log-normal (median 5 h, sigma 0.8: 61% >= 4 h) over 16 steps, cut at 6 h; staleness bound
    # 7; 8 runs a step on 4 slots a cell keep the paper's ~4.3 steps of runs in flight; a
    # 4-step calibration (medians) and a step trained on every cell at once (how many logical
    # GPUs train at full speed on the shared cores); one micro-batch per run. ``quick``
    # calibrates on 3 steps too (medians: a one-step calibration takes the first step's
    # finish, which pays the learner's warm-up, as every step's blocking finish).
    "paper8": dict(cells=8, steps=16, batch=4, group=2, slots=4, async_rollout=3, task_steps=16,
                   median_s=1125.0, latency_sigma=0.0, run_sigma=0.8, timeout_x=1.2, bound=7,
                   light=True, cal_steps=4, micro_batch_tokens=1),
}
"""Job sizes: ``smoke`` (CI, ~1 min), ``quick`` (a few minutes), ``full``, ``paper8`` (the
paper's cluster shape and run-length distribution, compressed; light runners: no model)."""


def build_config(size: dict, *, model_dir: str, seed: int, ranks_per_cell: int = 1):
    """The job of a size: ``task_steps`` tool calls of median ``median_s`` task seconds each,
    heavy-tailed (``latency_sigma``, default 1; ``run_sigma`` a per-run pace), a run capped at
    ``timeout_x`` (default 2.5) × task_steps × the median (wall clock); staleness ``bound``
    (default 1); ``light`` runners hold no model. ``ranks_per_cell`` > 1: each training cell's
    Learner is that many FSDP2 ranks (gloo on CPU; ``ShardingSettings.ranks_per_cell``)."""
    from ray_xlong.cells.config import CellJobConfig, LearnerSettings
    from ray_xlong.cells.sharding import ShardingSettings
    from ray_xlong.cells.long_horizon_job import LongHorizonJob
    from ray_xlong.cells.layout import CellLayout
    from ray_xlong.rollout import HarnessConfig
    from ray_xlong.rollout.tasks import LongHorizonConfig
    from ray_xlong.scheduling import SchedulingConfig

    timeout = size.get("timeout_x", 2.5) * size["task_steps"] * size["median_s"] / 3600
    work = LongHorizonJob(task=LongHorizonConfig(
        num_steps=size["task_steps"], latency_median_s=size["median_s"],
        latency_sigma=size.get("latency_sigma", 1.0), run_sigma=size.get("run_sigma", 0.0),
        time_scale=1 / 3600), seed=seed, model_logprobs=not size.get("light", False))
    return CellJobConfig(
        mode="colocated",
        job=SchedulingConfig(total_steps=size["steps"], batch_groups=size["batch"],
                             runs_per_group=size["group"],
                             staleness_bound=size.get("bound", 1)),
        layout=CellLayout(cells=size["cells"], nodes_per_cell=1, gpus_per_node=1),
        learner=LearnerSettings(model_dir=model_dir, lr=1e-4,
                                micro_batch_tokens=size.get("micro_batch_tokens", 4096)),
        slots_per_cell=size["slots"],
        async_rollout_cells=size["async_rollout"], work=work,
        harness=HarnessConfig(max_new_tokens=32, wall_clock_s=timeout, tool_timeout_s=timeout),
        sharding=ShardingSettings(ranks_per_cell=ranks_per_cell))


def calibrate(config, pool, *, steps: int = 1) -> dict:
    """A colocated job of ``steps`` one-group steps on a different seed: the simulator's cost
    model, measured. With ``steps`` > 1 the costs are medians (a learner's first step pays a
    warm-up, ~1 s here, that the job's later steps do not) and a sync back is measured."""
    from ray_xlong.cells.long_horizon_job import predicted_durations
    from ray_xlong.jobs.driver import run_job
    from ray_xlong.scheduling import SchedulingConfig

    job = SchedulingConfig(steps, 1, config.job.runs_per_group, 0)
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
    call_s = max(0.0, statistics.fmean(per_call)) if per_call else 0.0
    if steps > 1:
        costs = _robust_costs(t, runs=job.total_runs)
        return {"call_s": call_s, **costs,
                "parallel_training_cells": parallel_cells(config, pool, costs)}
    return {
        "call_s": call_s,
        "train_tokens_per_s": sum(t["micro_batch_targets"]) / sum(t["micro_batch_s"]),
        "tokens_per_run": sum(t["micro_batch_targets"]) / job.total_runs,
        "switch_s": statistics.fmean(t["switch_s"]),
        "sync_s": statistics.fmean(t["sync_s"]) if t.get("sync_s") else 0.0,
        "step_finish_s": statistics.fmean(t["step_finish_s"]),
    }


def parallel_cells(config, pool, costs: dict) -> float:
    """How many cells train at full speed at once: one colocated step whose runs give every
    cell a micro-batch, its per-micro-batch token rate against ``costs``' (a step of one group,
    one or two micro-batches at once): ``cells × rate_all / rate_one``, in [1, cells]. Logical
    GPUs on a few shared CPU cores do not add training throughput; real GPUs would give cells."""
    from ray_xlong.scheduling import SchedulingConfig
    from ray_xlong.jobs.driver import run_job

    g, cells = config.job.runs_per_group, config.layout.cells
    job = SchedulingConfig(2, max(1, cells // g), g, 0)
    work = dataclasses.replace(config.work, seed=config.work.seed + 20_000)
    t = run_job(dataclasses.replace(config, job=job, work=work, mode="colocated"), pool).timings
    rates = [n / s for n, s in zip(t["micro_batch_targets"], t["micro_batch_s"]) if s > 0]
    ratio = statistics.median(rates) / costs["train_tokens_per_s"]
    return min(float(cells), max(1.0, cells * ratio))


def _robust_costs(t: dict, *, runs: int) -> dict:
    """Medians of a multi-step calibration's timings (warm-up outliers do not move them)."""
    rates = [n / s for n, s in zip(t["micro_batch_targets"], t["micro_batch_s"]) if s > 0]
    return {
        "train_tokens_per_s": statistics.median(rates),
        "tokens_per_run": sum(t["micro_batch_targets"]) / runs,
        "switch_s": statistics.median(t["switch_s"]),
        "sync_s": statistics.median(t["sync_s"]) if t.get("sync_s") else 0.0,
        "step_finish_s": statistics.median(t["step_finish_s"]),
    }


def sim_inputs(config, cal: dict):
    """Workload, cluster and costs of the job for the simulator (seconds as its hours)."""
    from ray_xlong.cells.long_horizon_job import predicted_durations
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
                       sync_h=cal["sync_s"],
                       parallel_training_cells=cal.get("parallel_training_cells", float("inf")),
                       finish_blocks=True)  # the driver waits for each step's finish
    return workload, cluster, costs


def forecast_policy(config, cal: dict):
    """Our ForecastPolicy sized for this job from the calibration (seconds as its hours)."""
    per_s = cal["train_tokens_per_s"] / max(cal["tokens_per_run"], 1e-9) \
        / config.job.runs_per_group
    return make_policy("forecast", ModeInputs(train_groups_per_cell_h=per_s,
                                              horizon_h=config.harness.wall_clock_s))


def planned_prior(config, cal: dict):
    """The planned policy's estimates before the job's own events (it plans at job start with
    them): run durations of the calibration's workload (its seed, not the job's: 512 runs
    predicted from the tool times and the per-call cost) and the calibrated costs."""
    from ray_xlong.cells.long_horizon_job import predicted_durations
    from ray_xlong.sim.planner import prior_estimates

    work = dataclasses.replace(config.work, seed=config.work.seed + 10_000)
    durations = predicted_durations(work, runs=512, call_s=cal["call_s"],
                                    timeout_s=config.harness.wall_clock_s)
    per_group = cal["tokens_per_run"] * config.job.runs_per_group / cal["train_tokens_per_s"]
    return prior_estimates(durations, train_per_group=per_group, to_train=cal["switch_s"],
                           sync=cal["sync_s"], step_finish=cal["step_finish_s"])


def best_static_rollout_cells(config, cal: dict) -> int:
    """The async split (rollout cells) the simulator finds best for this job's calibrated
    workload: hindsight over 1..cells-1, ties to fewer rollout cells."""
    from ray_xlong.scheduling.asynchronous import AsyncPolicy
    from ray_xlong.sim.simulator import simulate

    workload, cluster, costs = sim_inputs(config, cal)
    hours = {r: simulate(AsyncPolicy(rollout_cells=r), workload=workload, cluster=cluster,
                         costs=costs, config=config.job).makespan_h
             for r in range(1, config.layout.cells)}
    return min(hours, key=lambda r: (hours[r], r))


def mode_policy(mode: str, config, cal: dict):
    """``(config of the real job, policy)`` of ``mode``: the same policy object drives Ray and
    the simulator."""
    from ray_xlong.cells.config import make_policy as job_policy

    if mode == "forecast":
        return dataclasses.replace(config, mode="elastic"), forecast_policy(config, cal)
    if mode == "forecast_online":
        return dataclasses.replace(config, mode="forecast"), make_policy("forecast_online")
    if mode == "planned":
        costs = PlanCosts(finish_blocks=True,
                          parallel_training_cells=cal.get("parallel_training_cells",
                                                          float("inf")),
                          wall_budget=PLAN_WALL_BUDGET)
        return dataclasses.replace(config, mode="planned"), planned_policy(
            costs=costs, prior=planned_prior(config, cal))
    if mode == "best_static":
        r = best_static_rollout_cells(config, cal)
        cfg = dataclasses.replace(config, mode="async", async_rollout_cells=r)
        return cfg, make_policy("best_static", ModeInputs(best_static_rollout_cells=r))
    cfg = dataclasses.replace(config, mode=mode)
    return cfg, job_policy(cfg)


def run_modes(config, pool, modes, cal: dict, *,
              on_mode: Callable[[str], None] | None = None) -> tuple[dict, dict, float]:
    """Every mode on Ray and in the simulator.

    Returns:
        ``(rows, logs, lower bound s)``: ``rows[mode]`` is a dict of measurements (see
        :func:`table`), ``logs[mode] = (ray events, simulator events)``.
    """
    from ray_xlong.cells.actuator import RayActuator
    from ray_xlong.cells.metrics import check_invariants

    reals = {}
    for mode in modes:
        if on_mode is not None:
            on_mode(mode)
        cfg, policy = mode_policy(mode, config, cal)
        _prepare(policy, cfg)
        reals[mode] = (cfg, policy, RayActuator(cfg, policy, pool).run())
    lb = _lower_bound(config, cal)
    rows, logs = {}, {}
    for mode, (cfg, policy, real) in reals.items():
        fresh = mode_policy(mode, config, cal)[1]  # fresh: policies learn
        _prepare(fresh, cfg)
        sim = _simulate(fresh, cfg, cal)
        rows[mode] = _row(real, sim, lb, check_invariants(
            real, staleness_bound=cfg.job.staleness_bound))
        if hasattr(policy, "plans"):
            walls = [plan.wall_s for plan in policy.plans]
            rows[mode]["plans"] = [{"time_s": plan.time, "version": plan.version,
                                    "chosen": plan.chosen, "wall_s": plan.wall_s}
                                   for plan in policy.plans]
            rows[mode]["plan_wall_s_total"] = sum(walls)
            rows[mode]["plan_wall_s_max"] = max(walls, default=0.0)
        if mode == "best_static":
            rows[mode]["split"] = {"rollout_cells": cfg.async_rollout_cells,
                                   "training_cells": cfg.layout.cells - cfg.async_rollout_cells}
        logs[mode] = (real.events, sim.events)
    for row in rows.values():
        base = rows.get("colocated", row)["makespan_s"]
        row["speedup_vs_colocated"] = base / row["makespan_s"]
        row["vs_elastic"] = row["makespan_s"] / rows.get("elastic", row)["makespan_s"]
        row["sim_vs_elastic"] = row["sim_makespan_s"] / rows.get("elastic", row)["sim_makespan_s"]
    return rows, logs, lb


def _prepare(policy, cfg) -> None:
    """A policy that plans ahead (planned, with its prior) plans before the job's clock."""
    if getattr(policy, "prior", None) is not None and hasattr(policy, "prepare"):
        policy.prepare(cfg.job, [cfg.slots_per_cell] * cfg.layout.cells)


def _simulate(policy, cfg, cal: dict):
    from ray_xlong.sim.simulator import simulate

    workload, cluster, costs = sim_inputs(cfg, cal)
    return simulate(policy, workload=workload, cluster=cluster, costs=costs, config=cfg.job)


def _lower_bound(config, cal: dict) -> float:
    from ray_xlong.sim.metrics import lower_bound_h

    workload, cluster, costs = sim_inputs(config, cal)
    return lower_bound_h(workload=workload, cluster=cluster, costs=costs, config=config.job)


def _row(real, sim, lb: float, violations: list[str]) -> dict:
    t = real.timing_summary()
    return {
        "makespan_s": real.makespan_s, "sim_makespan_s": sim.makespan_h,
        "sim_vs_real": sim.makespan_h / real.makespan_s - 1.0,
        "gpu_busy_frac": real.gpu_busy_frac, "sim_gpu_busy_frac": 1.0 - sim.gpu_idle_frac,
        "over_lower_bound": real.makespan_s / lb,
        "switch_s_mean": t.get("switch_s_mean", 0.0), "switch_s_max": t.get("switch_s_max", 0.0),
        "sync_s_mean": t.get("sync_s_mean", 0.0), "sync_s_max": t.get("sync_s_max", 0.0),
        "step_finish_s_mean": t.get("step_finish_s_mean", 0.0),
        "role_switches": int(t.get("switch_s_count", 0) + t.get("sync_s_count", 0)),
        "staleness_max": max(real.staleness), "token_staleness_max": real.token_staleness_max,
        "violations": violations, "placement_groups_created": real.placement_groups_created,
        "run_s_mean": _mean_run(real.events), "sim_run_s_mean": _mean_run(sim.events),
        "micro_batches": int(t.get("micro_batch_s_count", 0)),
        "micro_batch_s_mean": t.get("micro_batch_s_mean", 0.0),
        "micro_batch_tokens_mean": t.get("micro_batch_targets_mean", 0.0),
    }


def _mean_run(events) -> float:
    """Mean run duration of an event log (run_started → run_ended)."""
    began, took = {}, []
    for e in events:
        if e.kind == "run_started":
            began[e.run] = e.time
        elif e.kind == "run_ended" and e.run in began:
            took.append(e.time - began.pop(e.run))
    return statistics.fmean(took) if took else 0.0


def table(rows: dict) -> str:
    """Markdown table of the mode rows (ratios measured side by side in one run)."""
    head = ("| mode | makespan s | sim s | sim/real − 1 | ÷ elastic (sim) | × vs colocated | "
            "÷ lower bound | GPU busy (sim) | switch ms mean/max | sync ms mean/max | "
            "step finish ms |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for mode, r in rows.items():
        lines.append(
            f"| {mode} | {r['makespan_s']:.2f} | {r['sim_makespan_s']:.2f} | "
            f"{r['sim_vs_real']:+.1%} | {r['vs_elastic']:.2f} ({r['sim_vs_elastic']:.2f}) | "
            f"{r['speedup_vs_colocated']:.2f} | "
            f"{r['over_lower_bound']:.2f} | {r['gpu_busy_frac']:.2f} "
            f"({r['sim_gpu_busy_frac']:.2f}) | {1e3 * r['switch_s_mean']:.0f}/"
            f"{1e3 * r['switch_s_max']:.0f} | {1e3 * r['sync_s_mean']:.0f}/"
            f"{1e3 * r['sync_s_max']:.0f} | {1e3 * r['step_finish_s_mean']:.0f} |")
    return "\n".join(lines)


@dataclasses.dataclass(frozen=True, slots=True)
class ModesRun:
    """One comparison on Ray cells."""

    summary: dict
    """JSON-ready: ``seed``, ``size``, ``job``, ``cells``, ``slots_per_cell``,
    ``lower_bound_s``, ``calibration``, ``cells_startup_s``, ``wall_s``, ``modes`` (rows)."""
    logs: dict
    """``mode -> (ray events, simulator events)``."""


def run_comparison(*, size: str, seed: int, modes=MODES, address: str | None = None,
                   model_dir: str | None = None,
                   on_mode: Callable[[str], None] | None = None,
                   ranks_per_cell: int = 1) -> ModesRun:
    """Connect to Ray, build cells once, calibrate, run ``modes``; cells (and a Ray started
    here) go after.

    Args:
        size: a key of :data:`SIZES`.
        seed: workload seed.
        modes: subset of :data:`ALL_MODES`, run in this order.
        address: a Ray cluster to join (``"auto"`` after ``ray start``); None starts an
            embedded local Ray with one logical GPU per cell. A Ray this process is already
            connected to is used as it is (and left running).
        model_dir: the policy (a HF causal-LM directory every node can read); None builds a
            tiny local one (fine on one machine, not on a multi-node cluster).
        on_mode: called with each mode's name before it runs (progress).
        ranks_per_cell: Learner ranks per training cell (``build_config``).

    Returns:
        :class:`ModesRun`.
    """
    import ray

    from ray_xlong.cells.ray_edge import KEEP_TASK_WORKERS
    from ray_xlong.models import build_tiny_model_dir
    from ray_xlong.jobs.driver import start_cells

    if size not in SIZES:
        raise ValueError(f"size: unknown {size!r}; choose from {sorted(SIZES)}")
    bad = [m for m in modes if m not in ALL_MODES]
    if bad:
        raise ValueError(f"modes: unknown {bad}; choose from {ALL_MODES}")
    s = SIZES[size]
    tmp = tempfile.mkdtemp(prefix="rx", dir="/tmp")       # Ray socket paths stay short
    t0 = time.perf_counter()
    owned = not ray.is_initialized()                       # a connected Ray is used as is
    if owned and address is not None:
        ray.init(address=address, log_to_driver=False)
    elif owned:
        os.environ.setdefault("RAY_TMPDIR", tmp)
        ray.init(num_cpus=s["cells"], num_gpus=s["cells"], include_dashboard=False,
                 log_to_driver=False, _system_config=KEEP_TASK_WORKERS)
    try:
        if model_dir is None:
            model_dir = str(build_tiny_model_dir(f"{tmp}/m", seed=0))
        config = build_config(s, model_dir=model_dir, seed=seed, ranks_per_cell=ranks_per_cell)
        pool = start_cells(config)
        try:
            cal = calibrate(config, pool, steps=s.get("cal_steps", 1))
            rows, logs, lb = run_modes(config, pool, modes, cal, on_mode=on_mode)
        finally:
            pool.shutdown()
    finally:
        if owned:
            ray.shutdown()
    summary = {"seed": seed, "size": size, "job": dataclasses.asdict(config.job),
               "cells": s["cells"], "slots_per_cell": s["slots"], "lower_bound_s": lb,
               "calibration": cal, "cells_startup_s": pool.startup_s,
               "ranks_per_cell": ranks_per_cell,
               "wall_s": time.perf_counter() - t0, "modes": rows}
    return ModesRun(summary, logs)
