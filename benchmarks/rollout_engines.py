"""Rollout engines side by side: the same concurrent multi-turn agent runs on vLLM and HF.

Every engine serves the same workload: ``--runs`` concurrent harness runs of the arithmetic task
on one seeded tiny model, greedy (temperature 0), so both engines generate the same tokens and
the comparison is like for like. Each engine runs in its own subprocess (peak memory is that
process's max RSS). Printed as a markdown table with the vLLM / HF ratio; ``--json`` writes it.

    python benchmarks/rollout_engines.py --seed 0 --runs 16 --json out.json
    python benchmarks/rollout_engines.py --smoke            # tiny budget (CI smoke test)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def measure(engine_name: str, model_dir: str, runs: int, calls: int, new_tokens: int,
            seed: int) -> dict:
    """Run the workload on one engine in this process; returns its metrics."""
    import torch

    from ray_xlong.models import load_tokenizer
    from ray_xlong.rollout import ChatFormat, HFEngine, Harness, HarnessConfig
    from ray_xlong.rollout.tasks import ArithmeticTask

    torch.manual_seed(seed)
    start = time.perf_counter()
    if engine_name == "vllm":
        from ray_xlong.rollout.vllm_engine import VLLMEngine

        engine = VLLMEngine(model_dir, seed=seed, max_model_len=2048)
    else:
        engine = HFEngine(model_dir, seed=seed, max_batch_size=64)
    startup = time.perf_counter() - start
    harness = Harness(engine, ChatFormat(load_tokenizer(model_dir)), config=HarnessConfig(
        max_new_tokens=new_tokens, temperature=0.0, max_calls=calls, max_retries=1,
        context_capacity=2048, compaction_budget=1024, max_tool_output_tokens=64))
    envs = [ArithmeticTask(seed * 1000 + i) for i in range(runs)]
    start = time.perf_counter()
    results = asyncio.run(harness.run_many(envs, run_ids=[f"r{i}" for i in range(runs)],
                                           group_ids=["g"] * runs))
    wall = time.perf_counter() - start
    stats = engine.stats()
    return {"engine": engine_name, "runs": runs, "calls": sum(len(r.run.calls) for r in results),
            "output_tokens": stats.output_tokens, "prompt_tokens": stats.prompt_tokens,
            "wall_s": wall, "startup_s": startup, "tokens_per_s": stats.output_tokens / wall,
            "prefix_hit_rate": stats.prefix_hit_rate, "batches": stats.batches,
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def _child(args: argparse.Namespace, engine: str, model_dir: str) -> dict:
    cmd = [sys.executable, __file__, "--child", engine, "--model-dir", model_dir,
           "--runs", str(args.runs), "--calls", str(args.calls), "--new-tokens",
           str(args.new_tokens), "--seed", str(args.seed)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        return {"engine": engine, "error": out.stderr.strip().splitlines()[-1:]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def table(rows: list[dict]) -> str:
    keys = ["tokens_per_s", "output_tokens", "prompt_tokens", "prefix_hit_rate", "wall_s",
            "startup_s", "peak_rss_mib"]
    by = {r["engine"]: r for r in rows if "error" not in r}
    lines = ["| metric | " + " | ".join(by) + " | vllm / hf |",
             "|---" * (len(by) + 2) + "|"]
    for k in keys:
        ratio = (f"{by['vllm'][k] / by['hf'][k]:.2f}" if {"vllm", "hf"} <= set(by)
                 and by["hf"][k] else "n/a")
        lines.append(f"| {k} | " + " | ".join(f"{r[k]:.3g}" for r in by.values())
                     + f" | {ratio} |")
    for r in rows:
        if "error" in r:
            lines.append(f"\n{r['engine']}: failed ({r['error']})")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--runs", type=int, default=16)
    p.add_argument("--calls", type=int, default=6, help="model calls per run")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--engines", default="vllm,hf")
    p.add_argument("--smoke", action="store_true", help="tiny budget")
    p.add_argument("--json", default=None)
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--model-dir", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(measure(args.child, args.model_dir, args.runs, args.calls,
                                 args.new_tokens, args.seed)))
        return
    if args.smoke:
        args.runs, args.calls, args.new_tokens = 2, 2, 8
    from ray_xlong.models import build_tiny_model_dir
    from ray_xlong.rollout.vllm_engine import vllm_available

    with tempfile.TemporaryDirectory(prefix="xlong_bench_") as tmp:
        model_dir = str(build_tiny_model_dir(os.path.join(tmp, "model"), seed=args.seed))
        engines = [e for e in args.engines.split(",") if e != "vllm" or vllm_available()]
        rows = [_child(args, e, model_dir) for e in engines]
    print(table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"seed": args.seed, "runs": args.runs, "calls": args.calls,
                       "new_tokens": args.new_tokens, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
