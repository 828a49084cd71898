"""Learner state and gradients per training step: bytes through the driver and through each
Learner process, for models growing ≥ 20× (seeded; markdown + JSON).

The elastic learner group is driven as the actuator drives it — plan_step from run digests,
cells joining a step at different micro-batches, cells that sat out steps joining later —
for 4 cells (3 in the ``--quick`` CI run), single and 2-rank sharded (FSDP2, gloo) Learners.
Rollouts are Ray tasks that keep the runs' episodes where they ran (the driver gets digests
only, as from a runner), and each step's weights are fetched by a task as an engine would (the
object-store weight sync).

    driver bytes      every value the driver ``ray.get``s, ``ray.put``s or passes by value to
                      an actor call (``benchmarks/driver_bytes.py``'s ``Meter``)
    driver peak RSS   resident memory of the driver, sampled while the steps run
    Learner bytes     per Learner process (a rank of a sharded cell is one): what its state and
                      gradient calls move (``cells.collectives.traffic``: all-reduce, peer
                      state, weights and gradients through the object store, gathers); ``in``
                      is the acceptance (``out`` also holds the weights rank 0 publishes for
                      the engines, the weight sync's); runs' episodes are not counted
    shard             the fp32 weights a Learner process holds (params × 4 B ÷ ranks); the
                      state shard adds Adam's moments (× 3). ``max Learner in/step`` is the
                      mean over the steps (max over processes); the worst single step is a
                      join (its state shard) plus that step's all-reduce

Acceptance (issue 22): largest ÷ smallest model driver bytes ≤ 1.5 with parameters ≥ 20×,
≤ 1 MB + O(runs) per step; per Learner process ≤ 3 × its shard per step. A projection to the
mission's sizes follows from the measured per-parameter slopes.

    python benchmarks/state_bytes.py --seed 0 --steps 4 --json out.json
    python benchmarks/state_bytes.py --quick                      # tiny budget (CI)
"""

from __future__ import annotations

import os
import pathlib
import random
import statistics
import sys
import tempfile
import threading
import time
from typing import Any

import ray

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # benchmarks.tools
from benchmarks.driver_bytes import Meter  # noqa: E402
from benchmarks.tools.entry import bench_parser, finish  # noqa: E402

CELLS = 4
QUICK_CELLS = 3
"""``--quick``: 3 cells still have one that sits step 0 out and joins step 1 from a holder."""
RANKS = (1, 2)
"""Learner ranks per cell: a single Learner, a 2-rank sharded one."""
SIZES = {   # name: TinyModelConfig fields (head_dim 64)
    "0.4M": {},
    "3.5M": {"hidden_size": 256, "num_heads": 4, "num_kv_heads": 2, "num_layers": 4,
             "intermediate_size": 768},
    "13M": {"hidden_size": 512, "num_heads": 8, "num_kv_heads": 2, "num_layers": 4,
            "intermediate_size": 1536},
}
QUICK_SIZES = ("0.4M", "3.5M")
STATE_BYTES_PER_PARAM = 12
"""fp32 weights + Adam's two fp32 moments."""
PROJECTION = {"1.5B": 1.5e9, "8B": 8e9, "32B": 32e9, "70B": 70e9, "2.4T": 2.4e12}
MISSION = {"cells": 8, "gpus_per_cell": 32}
"""The reported system: 8 cells of 32 GPUs (one Learner rank per GPU)."""
MICRO_TOKENS = 300


@ray.remote(num_cpus=0)
def _build_model(path: str, fields: dict, seed: int) -> tuple[str, int]:
    """Write a tiny model dir (in a task: the driver never holds a model); its parameters."""
    from ray_xlong.models import build_tiny_model_dir, load_model
    from ray_xlong.models.tiny import TinyModelConfig

    out = str(build_tiny_model_dir(path, seed=seed, config=TinyModelConfig(**fields)))
    return out, sum(p.numel() for p in load_model(out).parameters())


@ray.remote(num_cpus=0, num_returns=2)
def _rollout(step: int, seed: int) -> tuple[list, list]:
    """One step's runs, ended and processed where they ran: (digests, episodes)."""
    from ray_xlong.rllib.episodes import run_to_episode
    from ray_xlong.trajectory.per_run import process_run
    from ray_xlong.trajectory.synthetic import SyntheticConfig, synthetic_runs

    cfg = SyntheticConfig(num_calls=8, vocab_size=64, context_budget=120, failed_prob=0.0)
    runs = synthetic_runs(seed * 1000 + step, groups=4, runs_per_group=3, config=cfg,
                          policy_version=step)
    processed = [process_run(r, _processor()) for r in runs]
    return ([p.digest for p in processed],
            [run_to_episode(r, processed=p) for r, p in zip(runs, processed)])


@ray.remote(num_cpus=0)
def _engine_load(weights: dict) -> int:
    """What an engine does with the step's weights ref: load it (here: count it)."""
    return sum(t.numel() * t.element_size() for t in weights.values())


def _processor():
    from ray_xlong.trajectory import ProcessorConfig

    return ProcessorConfig(row_tokens=256)


class PeakRss:
    """The driver's resident memory, sampled every 20 ms in a thread."""

    def __init__(self) -> None:
        self.peak = self.start = _rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            self.peak = max(self.peak, _rss())

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def start_cells(model_dir: str, ranks: int, n_cells: int) -> tuple[list, list]:
    """``n_cells`` Learners (actors or sharded cells); the list of their processes' handles."""
    from ray_xlong.cells.config import LearnerSettings
    from ray_xlong.cells.sharded_cell import start_sharded_cell
    from ray_xlong.cells.sharding import ShardingSettings
    from ray_xlong.rllib.learner import ConnectorBatches, XLongLearner, learner_config

    settings = LearnerSettings(model_dir=model_dir, lr=1e-3, dtype="float32")
    config, spec = learner_config(settings, processor=_processor())
    if ranks == 1:
        cells = [ray.remote(XLongLearner).options(num_cpus=0).remote(config=config,
                                                                      module_spec=spec)
                 for _ in range(n_cells)]
        processes = list(cells)
    else:
        cells = [start_sharded_cell(pg=None, settings=settings,
                                    sharding=ShardingSettings(ranks_per_cell=ranks),
                                    nodes_per_cell=1, gpus_per_node=0,
                                    batch_of=ConnectorBatches(config)) for _ in range(n_cells)]
        processes = [r for c in cells for r in c.ranks]
    ray.get([c.build.remote() for c in cells])
    return cells, processes


def _kill(cells: list) -> None:
    for c in cells:
        if hasattr(c, "kill"):
            c.kill()
        else:
            ray.kill(c, no_restart=True)


def train_elastic(group: Any, steps: int, seed: int, *,
                  after_step: Any = None) -> list[int]:
    """``steps`` steps of an elastic schedule: step ``s`` is trained by 2 or 3 of the group's
    cells from cell ``s mod cells`` on (so cells sit steps out and join later, loading the state
    from a holder), joining one micro-batch apart in a seeded order. Returns the runs of each
    step; ``after_step()`` runs after each."""
    from ray_xlong.cells.learner_group import plan_step

    rng = random.Random(seed)
    cells = len(group.learners)
    runs = []
    for step in range(steps):
        digests_ref, payload = _rollout.remote(step, seed)
        digests = ray.get(digests_ref)
        micro, _ = plan_step(digests, processor=_processor(), max_tokens=MICRO_TOKENS)
        members = [(step + i) % cells for i in range(2 + step % 2)]
        rng.shuffle(members)
        group.begin(step)
        refs = []
        for i, m in enumerate(micro):
            joined = members[:min(len(members), i + 1)]
            if joined[-1] not in group.members:
                refs.append(group.join(joined[-1]))
            refs.append(group.submit(joined[i % len(joined)], m, payloads=[payload]))
        ray.get(refs)
        group.finish()
        ray.get(_engine_load.remote(group.weights_ref))
        runs.append(len(digests))
        if after_step is not None:
            after_step()
    return runs


def measure(model_dir: str, params: int, ranks: int, steps: int, seed: int,
            n_cells: int) -> dict:
    """One size × layout: per-step driver and Learner bytes, the driver's peak RSS."""
    from ray_xlong.cells.learner_group import ElasticLearnerGroup

    cells, processes = start_cells(model_dir, ranks, n_cells)
    try:
        snapshots = [ray.get([p.traffic.remote() for p in processes])]
        meter = Meter()

        def snapshot() -> None:
            with meter.paused():
                snapshots.append(ray.get([p.traffic.remote() for p in processes]))

        with PeakRss() as rss, meter.watching():
            group = ElasticLearnerGroup(cells)
            t0 = time.perf_counter()
            runs = train_elastic(group, steps, seed, after_step=snapshot)
            seconds = time.perf_counter() - t0
    finally:
        _kill(cells)
    steps_in = [[_moved(b, a, "_in") for b, a in zip(before, after)]      # [step][process]
                for before, after in zip(snapshots, snapshots[1:])]
    steps_out = [[_moved(b, a, "_out") for b, a in zip(before, after)]
                 for before, after in zip(snapshots, snapshots[1:])]
    total = [{k: (a.get(k, 0) - b.get(k, 0)) / steps for k in a}
             for a, b in zip(snapshots[-1], snapshots[0])]
    shard = params * 4 // ranks
    return {"size": "", "params": params, "ranks_per_cell": ranks, "cells": n_cells,
            "steps": steps, "runs_per_step": statistics.mean(runs),
            "driver_bytes_per_step": (meter.bytes_in + meter.bytes_out) / steps,
            "driver_bytes_by_kind": {k: v / steps for k, v in meter.by_kind.items()},
            "driver_peak_rss_bytes": rss.peak, "driver_rss_growth_bytes": rss.peak - rss.start,
            "shard_bytes": shard, "state_shard_bytes": STATE_BYTES_PER_PARAM * params // ranks,
            "max_learner_bytes_per_step": max(sum(s[i] for s in steps_in) / steps
                                              for i in range(len(processes))),
            "max_learner_bytes_out_per_step": max(sum(s[i] for s in steps_out) / steps
                                                  for i in range(len(processes))),
            "worst_learner_step_bytes": max(max(s) for s in steps_in),
            "learner_bytes_by_kind": _max_by_kind(total),
            "peer_states": group.peer_states, "fallbacks": group.fallbacks,
            "seconds": seconds}


def _moved(before: dict, after: dict, suffix: str) -> int:
    return sum(v - before.get(k, 0) for k, v in after.items() if k.endswith(suffix))


def _max_by_kind(moved: list[dict]) -> dict[str, float]:
    return {k: max(m.get(k, 0) for m in moved) for k in sorted({k for m in moved for k in m})}


def projection(rows: list[dict]) -> list[dict]:
    """Per mission size: driver bytes per step (fit over the measured sizes), the state per
    GPU, Learner bytes per step per GPU (measured per shard byte), and what the durable copy
    this replaces moved through the driver (a get and a put of the state, a put of the
    weights: 28 B/param)."""
    rows = [r for r in rows if r["ranks_per_cell"] == max(x["ranks_per_cell"] for x in rows)]
    xs = [r["params"] for r in rows]
    ys = [r["driver_bytes_per_step"] for r in rows]
    slope = _slope(xs, ys)
    intercept = statistics.mean(ys) - slope * statistics.mean(xs)
    per_shard = max(r["max_learner_bytes_per_step"] / r["shard_bytes"] for r in rows)
    gpus = MISSION["gpus_per_cell"]
    return [{"model": name, "params": p,
             "driver_bytes_per_step": intercept + slope * p,
             "driver_slope_bytes_per_param": slope,
             "durable_copy_driver_bytes_per_step": 28 * p,
             "state_bytes_per_gpu": STATE_BYTES_PER_PARAM * p / gpus,
             "learner_bytes_per_step_per_gpu": per_shard * 4 * p / gpus}
            for name, p in PROJECTION.items()]


def _slope(xs: list[float], ys: list[float]) -> float:
    mx, my = statistics.mean(xs), statistics.mean(ys)
    den = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / den if den else 0.0


def acceptance(rows: list[dict]) -> dict:
    """The issue's checks, per layout."""
    out = {}
    for ranks in sorted({r["ranks_per_cell"] for r in rows}):
        mine = sorted((r for r in rows if r["ranks_per_cell"] == ranks),
                      key=lambda r: r["params"])
        small, large = mine[0], mine[-1]
        out[f"ranks_{ranks}"] = {
            "params_ratio": large["params"] / small["params"],
            "driver_bytes_ratio": large["driver_bytes_per_step"]
            / small["driver_bytes_per_step"],
            "max_driver_bytes_per_step": max(r["driver_bytes_per_step"] for r in mine),
            "max_learner_bytes_per_shard": max(r["max_learner_bytes_per_step"]
                                               / r["shard_bytes"] for r in mine)}
    return out


def run(seed: int, steps: int, sizes: tuple[str, ...], layouts: tuple[int, ...],
        n_cells: int = CELLS) -> dict:
    tmp = tempfile.mkdtemp(prefix="xlong_state_", dir="/tmp")
    os.environ.setdefault("RAY_TMPDIR", tmp)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             object_store_memory=400 * 2**20)
    rows = []
    try:
        models = ray.get([_build_model.remote(os.path.join(tmp, name), SIZES[name], seed)
                          for name in sizes])
        for name, (model_dir, params) in zip(sizes, models):
            for ranks in layouts:
                row = measure(model_dir, params, ranks, steps, seed, n_cells)
                row["size"] = name
                rows.append(row)
    finally:
        ray.shutdown()
    return {"seed": seed, "steps": steps, "cells": n_cells, "rows": rows,
            "acceptance": acceptance(rows), "projection": projection(rows),
            "mission": MISSION, "state_bytes_per_param": STATE_BYTES_PER_PARAM}


def _b(n: float) -> str:
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"


def print_table(result: dict) -> None:
    print(f"\n## Learner state and gradients per step ({result['cells']} cells, elastic, "
          f"{result['steps']} steps)\n")
    print("| model | params | ranks/cell | runs/step | driver B/step | driver peak RSS | "
          "shard (fp32) | max Learner in/step | ÷ shard | worst step in ÷ shard | "
          "÷ state shard | max Learner out/step | peer states | fallbacks |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in result["rows"]:
        print(f"| {r['size']} | {r['params']:,} | {r['ranks_per_cell']} | "
              f"{r['runs_per_step']:.0f} | {_b(r['driver_bytes_per_step'])} | "
              f"{_b(r['driver_peak_rss_bytes'])} | {_b(r['shard_bytes'])} | "
              f"{_b(r['max_learner_bytes_per_step'])} | "
              f"{r['max_learner_bytes_per_step'] / r['shard_bytes']:.2f} | "
              f"{r['worst_learner_step_bytes'] / r['shard_bytes']:.2f} | "
              f"{r['worst_learner_step_bytes'] / r['state_shard_bytes']:.2f} | "
              f"{_b(r['max_learner_bytes_out_per_step'])} | {r['peer_states']} | "
              f"{r['fallbacks']} |")
    print("\n| layout | params × | driver bytes × | max driver B/step | max Learner in ÷ "
          "shard |")
    print("|---|---|---|---|---|")
    for name, a in result["acceptance"].items():
        print(f"| {name} | {a['params_ratio']:.1f} | {a['driver_bytes_ratio']:.2f} | "
              f"{_b(a['max_driver_bytes_per_step'])} | "
              f"{a['max_learner_bytes_per_shard']:.2f} |")
    m = result["mission"]
    print(f"\n### Projection ({m['cells']} cells × {m['gpus_per_cell']} GPUs, "
          f"{result['state_bytes_per_param']} B/param weights + Adam)\n")
    print("| model | driver B/step | before: durable copy through the driver | state per GPU "
          "| Learner in/step per GPU |")
    print("|---|---|---|---|---|")
    for p in result["projection"]:
        print(f"| {p['model']} | {_b(p['driver_bytes_per_step'])} | "
              f"{_b(p['durable_copy_driver_bytes_per_step'])} | "
              f"{_b(p['state_bytes_per_gpu'])} | "
              f"{_b(p['learner_bytes_per_step_per_gpu'])} |")


def main(argv: list[str] | None = None) -> dict:
    parser = bench_parser(__doc__)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--quick", action="store_true",
                        help=f"CI budget: sizes {QUICK_SIZES}, {QUICK_CELLS} single-Learner "
                             f"cells, 2 steps")
    args = parser.parse_args(argv)
    quick = args.quick or args.smoke
    sizes = QUICK_SIZES if quick else tuple(SIZES)
    layouts = (1,) if quick else RANKS
    result = run(args.seed, 2 if quick else args.steps, sizes, layouts,
                 QUICK_CELLS if quick else CELLS)
    return finish(result, show=print_table, json_path=args.json)


if __name__ == "__main__":
    main()
