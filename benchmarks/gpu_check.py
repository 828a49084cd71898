"""One short run through every GPU path (``--device cuda``), or the same stages at tiny size on
CPU (``--device cpu``, in CI so the script cannot rot).

| stage          | cuda                                          | cpu                              |
|----------------|-----------------------------------------------|----------------------------------|
| engine         | vLLM GPU engine(s) serving agent runs          | EngineSet of 2 HF engines        |
| sleep_wake     | vLLM sleep(level=1) / wake_up (real sleep mode)| HF engine sleep / wake           |
| weight_reload  | engines asleep, Learner step, weights in, wake | same (s/GB reported)             |
| tree_step      | tree batch with flex_attention vs per-traj.    | xlong_tree vs per-trajectory     |
| fsdp_step      | FSDP2 cell, a rank per visible GPU (NCCL, bf16)| 2-rank cell (gloo)               |
| elastic_2cell  | 2 one-rank cells time-sharing GPU 0, the second| same; weights vs fsdp_step's     |
|                | joins mid-step                                 |                                  |

Each stage runs even when an earlier one failed (its error goes in the table); the exit code is
1 when any failed. ``--torch-only`` runs the stages that need only torch and transformers
instead (``gpu_check_torch.py``: tree attention, its scaling to 64k tokens, a LearnerRank step
with sleep / wake, two ranks with weight sync and a lost peer): it imports neither Ray nor
vLLM, for GPU machines that have neither. What has run on a GPU: ``docs/gpu-first-run.md``.

    python benchmarks/gpu_check.py --device cuda --torch-only --json gpu_torch.json
    python benchmarks/gpu_check.py --device cuda --json gpu.json
    python benchmarks/gpu_check.py --device cpu --seed 0 --json cpu.json
"""

from __future__ import annotations

import asyncio
import dataclasses
import pathlib
import sys
import tempfile
import time
import traceback
from typing import Any, Callable

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # benchmarks.tools
from benchmarks.tools.entry import bench_parser, finish  # noqa: E402
from ray_xlong.models import build_tiny_model_dir, load_model  # noqa: E402
from ray_xlong.trajectory import ProcessorConfig, TrajectoryProcessor
from ray_xlong.trajectory.synthetic import SyntheticConfig, synthetic_runs


@dataclasses.dataclass(slots=True)
class Ctx:
    """What the stages share."""

    device: str
    seed: int
    model_dir: str
    engines: Any = None
    weights: dict | None = None
    cell_weights: dict | None = None


def runs_for(ctx: Ctx, groups: int = 2):
    cfg = SyntheticConfig(num_calls=8, vocab_size=64, context_budget=160, failed_prob=0.0)
    return synthetic_runs(ctx.seed, groups=groups, runs_per_group=3, config=cfg, policy_version=0)


def stage_engine(ctx: Ctx) -> dict:
    from ray_xlong.cells.cell_engines import engine_set_factory
    from ray_xlong.cells.engines import EngineLayout
    from ray_xlong.rollout import HarnessConfig, HFEngine, Harness, load_chat_format
    from ray_xlong.rollout.tasks import make_task

    if ctx.device == "cuda":
        from ray_xlong.rollout.vllm_engine import VLLMEngine

        n = max(1, torch.cuda.device_count())
        layout = EngineLayout(engines_per_cell=1, tensor_parallel_size=1)
        make = lambda i, tp: VLLMEngine(ctx.model_dir, seed=i,  # noqa: E731
                                        tensor_parallel_size=tp)
    else:
        n, layout = 2, EngineLayout(engines_per_cell=2)
        make = lambda i, tp: HFEngine(ctx.model_dir, seed=i)  # noqa: E731
    layout.check(nodes_per_cell=1, gpus_per_node=n if ctx.device == "cuda" else 0)
    engines = engine_set_factory(layout, make)()
    ctx.engines = engines
    harness = Harness(engines, load_chat_format(ctx.model_dir),
                      config=HarnessConfig(max_new_tokens=16, max_calls=4))
    t0 = time.perf_counter()
    results = asyncio.run(harness.run_many(
        [make_task("arithmetic", seed=ctx.seed + s) for s in range(4)],
        run_ids=[f"r{s}" for s in range(4)], group_ids=["g"] * 4))
    seconds = time.perf_counter() - t0
    stats = engines.stats()
    return {"seconds": seconds, "engines": len(engines.engines), "runs": len(results),
            "calls": stats.requests, "output_tok_per_s": stats.output_tokens / seconds,
            "runs_per_engine": list(engines.runs_served)}  # a copy: later stages serve more


def stage_sleep_wake(ctx: Ctx) -> dict:
    async def go() -> tuple[float, float]:
        t0 = time.perf_counter()
        await ctx.engines.sleep()
        t1 = time.perf_counter()
        await ctx.engines.wake_up()
        return t1 - t0, time.perf_counter() - t1
    sleep_s, wake_s = asyncio.run(go())
    out = {"seconds": sleep_s + wake_s, "sleep_s": sleep_s, "wake_s": wake_s}
    if ctx.device == "cuda":   # a real vLLM sleep, not the CPU fallback (shutdown / rebuild)
        out["vllm_sleep_mode"] = all(e._sleep_mode for e in ctx.engines.engines)
        if not out["vllm_sleep_mode"]:
            raise RuntimeError("vLLM fell back to shutdown/rebuild: sleep mode not available")
    return out


def stage_weight_reload(ctx: Ctx) -> dict:
    """Colocated order: engines asleep, a Learner step on the freed device, the new weights
    sent while asleep, loaded at wake-up; then the engines serve a run."""
    from ray_xlong.rollout import HarnessConfig, Harness, load_chat_format
    from ray_xlong.rollout.tasks import make_task
    from ray_xlong.trajectory.accumulate import accumulate_loss
    from ray_xlong.trajectory.packing import micro_batches

    asyncio.run(ctx.engines.sleep())
    model = load_model(ctx.model_dir).to(ctx.device).train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    packed = TrajectoryProcessor(ProcessorConfig()).process(runs_for(ctx, 1)).packed
    for m in micro_batches(packed, max_tokens=4096):
        accumulate_loss(model, _to(m, ctx.device))
    opt.step()
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    gb = sum(v.numel() * v.element_size() for v in sd.values()) / 1e9

    async def reload() -> float:
        t0 = time.perf_counter()
        await ctx.engines.update_weights(sd, version=1)
        await ctx.engines.wake_up()
        return time.perf_counter() - t0
    seconds = asyncio.run(reload())
    del model, opt
    assert ctx.engines.policy_version == 1
    harness = Harness(ctx.engines, load_chat_format(ctx.model_dir),
                      config=HarnessConfig(max_new_tokens=8, max_calls=2))
    served = asyncio.run(harness.run_many([make_task("arithmetic", seed=ctx.seed)],
                                          run_ids=["after-reload"], group_ids=["g"]))
    return {"seconds": seconds, "gb": gb, "s_per_gb": seconds / gb,
            "engines": len(ctx.engines.engines), "runs_after": len(served)}


def stage_tree_step(ctx: Ctx) -> dict:
    from ray_xlong.trajectory.accumulate import accumulate_loss
    from ray_xlong.trajectory.packing import micro_batches
    from ray_xlong.trajectory.tree_attention import register

    register()
    runs = runs_for(ctx, 1)
    attn = "flex_attention" if ctx.device == "cuda" else "xlong_tree"
    out = {"attn": attn}
    for pack, impl in (("per_trajectory", "sdpa"), ("tree", attn)):
        batch = TrajectoryProcessor(ProcessorConfig(pack=pack)).process(runs)
        model = load_model(ctx.model_dir, attn_implementation=impl).to(ctx.device).train()
        micro = [_to(m, ctx.device) for m in micro_batches(batch.packed, max_tokens=4096)]
        accumulate_loss(model, micro[0])                    # warm-up (kernels, compile)
        _sync(ctx)
        t0 = time.perf_counter()
        for m in micro:
            accumulate_loss(model, m)
        _sync(ctx)
        out[f"{pack}_s"] = time.perf_counter() - t0
        out["bound"] = batch.stats.total_tokens / batch.stats.unique_tokens
    out["speedup"] = out["per_trajectory_s"] / out["tree_s"]
    out["ratio_to_bound"] = out["speedup"] / out["bound"]
    out["seconds"] = out["per_trajectory_s"] + out["tree_s"]
    return out


def stage_fsdp_step(ctx: Ctx) -> dict:
    import ray

    from ray_xlong.cells.learner_group import ElasticLearnerGroup

    ranks = max(1, torch.cuda.device_count()) if ctx.device == "cuda" else 2
    cell = _cell(ctx, ranks)
    t0 = time.perf_counter()
    group = ElasticLearnerGroup([cell])
    micro, payloads = _plan(runs_for(ctx))
    group.begin(0)
    ray.get(group.join(0))
    ray.get([group.submit(0, m, payloads=payloads) for m in micro])
    group.finish()
    seconds = time.perf_counter() - t0
    ctx.cell_weights = ray.get(cell.get_weights.remote())
    ctx.weights = {"cell": cell, "initial": ray.get(cell.get_xlong_state.remote())}
    return {"seconds": seconds, "ranks": ranks, "micro_batches": len(micro),
            "backend": "nccl" if ctx.device == "cuda" else "gloo"}


def stage_elastic_2cell(ctx: Ctx) -> dict:
    import ray

    from ray_xlong.cells.learner_group import ElasticLearnerGroup

    if ctx.device == "cuda":   # two 1-rank cells sharing the first GPU (half each)
        if ctx.weights:
            ctx.weights["cell"].kill()
        first, second = _cell(ctx, 1, one_gpu=True), _cell(ctx, 1, one_gpu=True)
    else:
        first = ctx.weights["cell"] if ctx.weights else _cell(ctx, 1)
        second = _cell(ctx, 1)
    fresh = ray.get(second.get_xlong_state.remote())       # version 0, as the first one began
    ray.get(first.set_xlong_state.remote(fresh))
    t0 = time.perf_counter()
    group = ElasticLearnerGroup([first, second])
    micro, payloads = _plan(runs_for(ctx))
    group.begin(0)
    ray.get(group.join(0))
    refs, half = [], len(micro) // 2
    for i, m in enumerate(micro):
        if i == half:
            ray.get(group.join(1))                          # the second cell joins mid-step
        refs.append(group.submit(0 if i < half else 1, m, payloads=payloads))
    ray.get(refs)
    group.finish()
    seconds = time.perf_counter() - t0
    got = ray.get(second.get_weights.remote())
    out = {"seconds": seconds, "cells": 2, "joined_at_micro_batch": half}
    if ctx.cell_weights:
        want = ctx.cell_weights
        out["rel_diff_vs_fsdp_step"] = max(
            float((got[k] - want[k]).norm() / want[k].norm().clamp_min(1e-30)) for k in want)
    return out


CELL_PROC = ProcessorConfig(row_tokens=256)   # the sharded cells' packing


def _plan(runs: list) -> tuple[list, list]:
    """What the actuator hands the group: micro-batches planned from the runs' digests and one
    payload ref with their episodes, processed as a rollout cell does where they ended."""
    import ray

    from ray_xlong.cells.learner_group import plan_step
    from ray_xlong.rllib.episodes import run_to_episode
    from ray_xlong.trajectory.per_run import process_run

    processed = [process_run(r, CELL_PROC) for r in runs]
    payload = ray.put([run_to_episode(r, processed=p) for r, p in zip(runs, processed)])
    micro, _ = plan_step([p.digest for p in processed], processor=CELL_PROC, max_tokens=1000)
    return micro, [payload]


def _cell(ctx: Ctx, ranks: int, *, one_gpu: bool = False):
    """A sharded cell of ``ranks`` ranks (CUDA: ranks pinned to the visible GPUs, or all to the
    first one with ``one_gpu`` — two 1-rank cells time-share it as colocated cells do)."""
    import ray

    from ray_xlong.cells.config import LearnerSettings
    from ray_xlong.cells.sharded_cell import start_sharded_cell
    from ray_xlong.cells.sharding import ShardingSettings
    from ray_xlong.rllib.learner import ConnectorBatches, learner_config

    settings = LearnerSettings(model_dir=ctx.model_dir, lr=1e-3)
    sharding = ShardingSettings(ranks_per_cell=ranks, device=ctx.device,
                                mixed_precision="bf16" if ctx.device == "cuda" else None)
    ids = _visible_gpus()[:1 if one_gpu else ranks] if ctx.device == "cuda" else []
    cell = start_sharded_cell(pg=None, settings=settings, sharding=sharding, nodes_per_cell=1,
                              gpus_per_node=len(ids), held_gpu_ids=[ids] if ids else (),
                              batch_of=ConnectorBatches(learner_config(settings,
                                                                       processor=CELL_PROC)[0]))
    ray.get(cell.build.remote())
    return cell


def _visible_gpus() -> list[str]:
    """This process's CUDA devices as ``CUDA_VISIBLE_DEVICES`` names them."""
    import os

    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    return env.split(",") if env else [str(i) for i in range(torch.cuda.device_count())]


def _to(micro, device: str):
    from ray_xlong.trajectory.packing import PackedBatch

    t = micro.to_tensors()
    return PackedBatch.from_tensors({k: v if k in ("run_ids", "layout") else v.to(device)
                                     for k, v in t.items()})


def _sync(ctx: Ctx) -> None:
    if ctx.device == "cuda":
        torch.cuda.synchronize()


STAGES: dict[str, Callable[[Ctx], dict]] = {
    "engine": stage_engine, "sleep_wake": stage_sleep_wake, "weight_reload": stage_weight_reload,
    "tree_step": stage_tree_step, "fsdp_step": stage_fsdp_step,
    "elastic_2cell": stage_elastic_2cell}


def run(device: str, seed: int) -> dict:
    import ray

    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("gpu_check --device cuda: torch sees no CUDA device")
    import os

    torch.manual_seed(seed)
    root = tempfile.mkdtemp(prefix="gpu_check_")
    for var in ("TORCHINDUCTOR_CACHE_DIR", "VLLM_CACHE_ROOT", "TRITON_CACHE_DIR"):
        os.environ.setdefault(var, os.path.join(root, var.lower()))   # no cache in $HOME
    ctx = Ctx(device, seed, str(build_tiny_model_dir(os.path.join(root, "model"), seed=seed)))
    ray.init(num_cpus=2 if device == "cpu" else None, include_dashboard=False,
             object_store_memory=300 * 1024 ** 2 if device == "cpu" else None)
    results = {}
    try:
        for name, stage in STAGES.items():
            t0 = time.perf_counter()
            try:
                results[name] = {"ok": True, **stage(ctx)}
            except Exception as exc:  # noqa: BLE001 - a stage's failure is a table row
                traceback.print_exc()
                results[name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:300],
                                 "seconds": time.perf_counter() - t0}
    finally:
        if ctx.engines is not None:
            asyncio.run(ctx.engines.close())
        ray.shutdown()
    return {"device": device, "seed": seed, "torch": torch.__version__,
            "gpus": torch.cuda.device_count() if torch.cuda.is_available() else 0,
            "stages": results}


def print_table(result: dict) -> None:
    flag = " --torch-only" if result.get("torch_only") else ""
    print(f"\n## gpu_check --device {result['device']}{flag} (GPUs: {result['gpus']}, torch "
          f"{result['torch']})\n")
    print("| stage | ok | s | details |")
    print("|---|---|---|---|")
    for name, r in result["stages"].items():
        details = ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}"
                            for k, v in r.items() if k not in ("ok", "seconds"))
        print(f"| {name} | {'yes' if r['ok'] else 'NO'} | {r['seconds']:.2f} | {details} |")
    print()


def main(argv: list[str] | None = None) -> dict:
    parser = bench_parser(__doc__, smoke=False)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--torch-only", action="store_true",
                        help="only the stages that need torch + transformers (no Ray, no vLLM)")
    args = parser.parse_args(argv)
    if args.torch_only:
        sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
        from gpu_check_torch import run as run_torch_only

        result = run_torch_only(args.device, args.seed)
    else:
        result = run(args.device, args.seed)
    return finish(result, show=print_table, json_path=args.json)


if __name__ == "__main__":
    out = main()
    sys.exit(0 if all(r["ok"] for r in out["stages"].values()) else 1)
