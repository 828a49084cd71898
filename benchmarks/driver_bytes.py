"""Bytes through the driver per training step of ``XLongAlgorithm`` (seeded; markdown + JSON).

The README picture says the driver handles refs and small per-run stats, never token tensors.
This counts what actually passes through the driver process while ``algo.train()`` runs:

    in   every value the driver ``ray.get``s (pickled size)
    out  every argument the driver passes *by value* to an actor call, and every ``ray.put``
         (object refs passed along cost nothing: the callee fetches them from where they live)

A small job (2 cells, the ``lookup`` task, HF engines, a tiny model) runs ``--steps`` steps; the
tables give bytes per step in and out, and by kind: ``runs`` (ended runs or their digests),
``micro`` (what the learners train on), ``state`` (learner weights / Adam state: none since
the state stays on the learners, ``cells/collectives.py``), ``other`` (role calls, run specs).
The state's bytes per model size, driver and Learner side: ``benchmarks/state_bytes.py``.

    python benchmarks/driver_bytes.py --seed 0 --steps 4 --json out.json
    python benchmarks/driver_bytes.py --smoke                          # tiny budget (CI)
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import statistics
import sys
import tempfile

import cloudpickle
import ray
from ray.actor import ActorMethod


sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # benchmarks.tools
from benchmarks.tools.entry import bench_parser, finish  # noqa: E402


def _size(value) -> int:
    """Pickled bytes of ``value`` (0 for object refs: they travel as ids)."""
    if isinstance(value, ray.ObjectRef):
        return 0
    try:
        return len(cloudpickle.dumps(value))
    except Exception:  # noqa: BLE001 - an unpicklable value is not sent by value either
        return 0


def _kind(value, method: str = "") -> str:
    """What a value is: ``runs`` (ended runs / their digests), ``micro`` (training inputs),
    ``state`` (learner weights / optimizer state) or ``other``."""
    if method.startswith("accumulate"):
        return "micro"
    if isinstance(value, dict) and ("weights" in value or "optimizer" in value):
        return "state"
    if isinstance(value, dict) and value and all(hasattr(v, "shape") for v in value.values()):
        return "state"                                   # a weights dict
    if isinstance(value, (list, tuple)) and value and type(value[0]).__name__ in (
            "RunResult", "RunDigest", "AgentRun"):
        return "runs"
    return "other"


class Meter:
    """Counts bytes into (``ray.get``) and out of (by-value arguments, ``ray.put``) the driver,
    by kind (:func:`_kind`)."""

    def __init__(self) -> None:
        self.bytes_in = 0
        self.bytes_out = 0
        self.by_kind: dict[str, int] = {}

    def add(self, direction: str, value, method: str = "") -> None:
        n = _size(value)
        if direction == "in":
            self.bytes_in += n
        else:
            self.bytes_out += n
        key = f"{direction}:{_kind(value, method)}"
        self.by_kind[key] = self.by_kind.get(key, 0) + n

    @contextlib.contextmanager
    def watching(self):
        get, put, remote = ray.get, ray.put, ActorMethod.remote
        meter = self

        def counted_get(refs, *args, **kwargs):
            value = get(refs, *args, **kwargs)
            for v in (value if isinstance(refs, list) else [value]):
                meter.add("in", v)
            return value

        def counted_put(value, *args, **kwargs):
            meter.add("out", value)
            return put(value, *args, **kwargs)

        def counted_remote(self_, *args, **kwargs):
            method = getattr(self_, "_method_name", "")
            for a in (*args, *kwargs.values()):
                meter.add("out", a, method)
            return remote(self_, *args, **kwargs)

        self._originals = (get, put, remote)
        ray.get, ray.put, ActorMethod.remote = counted_get, counted_put, counted_remote
        try:
            yield self
        finally:
            ray.get, ray.put, ActorMethod.remote = get, put, remote

    @contextlib.contextmanager
    def paused(self):
        """Inside :meth:`watching`: the driver's calls go uncounted (a benchmark's own
        probes)."""
        counted = ray.get, ray.put, ActorMethod.remote
        ray.get, ray.put, ActorMethod.remote = self._originals
        try:
            yield self
        finally:
            ray.get, ray.put, ActorMethod.remote = counted


def run(seed: int, steps: int, runs_per_group: int, groups: int) -> dict:
    from ray_xlong.models import build_tiny_model_dir
    from ray_xlong.rllib.algorithm_config import XLongConfig

    tmp = tempfile.mkdtemp(prefix="xlong_bytes_", dir="/tmp")
    os.environ.setdefault("RAY_TMPDIR", tmp)
    model_dir = str(build_tiny_model_dir(os.path.join(tmp, "policy"), seed=seed))
    ray.init(num_cpus=2, num_gpus=2, include_dashboard=False, log_to_driver=False,
             object_store_memory=300 * 2**20)
    try:
        config = (XLongConfig().lookup_recipe()
                  .training(train_batch_size_per_learner=groups * runs_per_group)
                  .debugging(seed=seed)
                  .xlong(mode="elastic", cells=2, runs_per_group=runs_per_group,
                         slots_per_cell=groups * runs_per_group, model_dir=model_dir,
                         placement_strategy="PACK", max_steps=steps + 1))
        algo = config.build_algo()
        per_step = []
        meter = Meter()
        with meter.watching():
            for _ in range(steps):
                before_in, before_out = meter.bytes_in, meter.bytes_out
                kinds = dict(meter.by_kind)
                result = algo.train()
                per_step.append({"runs": int(result["xlong"]["runs"]),
                                 "bytes_in": meter.bytes_in - before_in,
                                 "bytes_out": meter.bytes_out - before_out,
                                 "by_kind": {k: v - kinds.get(k, 0)
                                             for k, v in meter.by_kind.items()},
                                 "total_tokens": int(result["xlong"]["total_tokens"])})
        algo.stop()
    finally:
        ray.shutdown()
    runs = sum(s["runs"] for s in per_step)
    return {"seed": seed, "steps": per_step,
            "bytes_in_per_step": statistics.mean(s["bytes_in"] for s in per_step),
            "bytes_out_per_step": statistics.mean(s["bytes_out"] for s in per_step),
            "bytes_per_run": sum(s["bytes_in"] + s["bytes_out"] for s in per_step) / max(runs, 1)}


def print_table(result: dict) -> None:
    print("\n## Bytes through the driver per step\n")
    print("| step | runs | Σ trajectory tokens | in (ray.get) KB | out (args + put) KB |")
    print("|---|---|---|---|---|")
    for i, s in enumerate(result["steps"], start=1):
        print(f"| {i} | {s['runs']} | {s['total_tokens']:,} | {s['bytes_in'] / 1e3:.1f} | "
              f"{s['bytes_out'] / 1e3:.1f} |")
    kinds = sorted({k for s in result["steps"] for k in s["by_kind"]})
    print("\n| step | " + " | ".join(f"{k} KB" for k in kinds) + " |")
    print("|---|" + "---|" * len(kinds))
    for i, s in enumerate(result["steps"], start=1):
        print(f"| {i} | " + " | ".join(f"{s['by_kind'].get(k, 0) / 1e3:.1f}" for k in kinds)
              + " |")
    print(f"\nmean per step: in {result['bytes_in_per_step'] / 1e3:.1f} KB, out "
          f"{result['bytes_out_per_step'] / 1e3:.1f} KB; per trained run "
          f"{result['bytes_per_run'] / 1e3:.1f} KB (in + out)")


def main(argv: list[str] | None = None) -> dict:
    parser = bench_parser(__doc__)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--runs-per-group", type=int, default=4)
    parser.add_argument("--groups", type=int, default=2)
    args = parser.parse_args(argv)
    steps = 1 if args.smoke else args.steps
    result = run(args.seed, steps, args.runs_per_group, args.groups)
    return finish(result, show=print_table, json_path=args.json)


if __name__ == "__main__":
    main()
