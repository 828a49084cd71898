"""Benchmark of the trajectory processor (seeded; prints markdown tables, writes JSON).

1. Processing a paper-scale run (636 calls, context to ~700k tokens): wall time and peak memory
   (tracemalloc), against two references: the *memory-compare limit* (one ``np.array_equal`` pass
   over the run's token bytes) and the token bytes themselves.
2. Dedup: Σ trajectory tokens, unique (tree) tokens and trained tokens, before and after the cap.
3. One training step (forward + backward) of a tiny causal LM on CPU, tree-packed vs
   per-trajectory on the same runs: speedup and its ratio to the bound Σ trajectory tokens ÷
   unique tokens. Both sides run one sequence per forward (no padding waste on either side).
   The tree side uses ``xlong_tree`` attention (segments, no dense mask); ``--dense`` adds the
   dense-mask sdpa variant for comparison.
4. With ``--device cuda``: the same step on the GPU, tree with flex_attention + a tree BlockMask
   against per-trajectory sdpa.

    python benchmarks/trajectory_processor.py --seed 0 --json out.json
    python benchmarks/trajectory_processor.py --smoke           # tiny budget (CI)
"""

from __future__ import annotations

import dataclasses
import gc
import pathlib
import statistics
import sys
import time
import tracemalloc

import numpy as np
import torch

from ray_xlong.models import TinyModelConfig, tiny_causal_lm
from ray_xlong.trajectory import (
    LossConfig,
    ProcessorConfig,
    TrajectoryProcessor,
    assemble,
    policy_loss,
)
from ray_xlong.trajectory.assembly import _root
from ray_xlong.trajectory.model import token_logprobs
from ray_xlong.trajectory.packing import micro_batches
from ray_xlong.trajectory.synthetic import (
    SyntheticConfig,
    synthetic_run,
    synthetic_runs,
)


sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # benchmarks.tools
from benchmarks.tools.entry import bench_parser, finish  # noqa: E402


def _best_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        gc.collect()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def _peak_bytes(fn) -> int:
    gc.collect()
    tracemalloc.start()
    fn()
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return peak


def token_storage(run) -> tuple[int, int]:
    """(bytes of the distinct token buffers the run's records view, Σ input_ids bytes as sent)."""
    roots = {}
    for c in run.calls:
        for arr in (c.input_ids, c.output_ids):
            root = _root(arr)
            roots[id(root)] = root.nbytes
    return sum(roots.values()), sum(c.input_ids.nbytes for c in run.calls)


def bench_paper_run(seed: int, config: SyntheticConfig, repeats: int) -> dict:
    run = synthetic_run(np.random.default_rng(seed), run_id="paper", group_id="g",
                        config=config)
    stored, sent = token_storage(run)
    buffers = list({id(_root(a)): _root(a) for c in run.calls
                    for a in (c.input_ids, c.output_ids)}.values())
    a = np.concatenate(buffers)
    b = a.copy()
    compare_s = _best_time(lambda: np.array_equal(a, b), repeats)
    out = {"calls": len(run.calls), "max_context": max(c.input_ids.size for c in run.calls),
           "token_buffers": len(buffers), "token_bytes": stored, "input_bytes_as_sent": sent,
           "compare_s": compare_s}
    for pack in ("none", "tree"):
        proc = TrajectoryProcessor(ProcessorConfig(pack=pack, row_tokens=None))
        proc.process([run])                                   # warm-up
        out[f"process_{pack}_s"] = _best_time(lambda: proc.process([run]), repeats)
        out[f"process_{pack}_peak_bytes"] = _peak_bytes(lambda: proc.process([run]))
    out["trajectories"] = len(assemble(run))
    return out


def dedup_rows(seed: int, config: SyntheticConfig, k: int) -> list[dict]:
    run = synthetic_run(np.random.default_rng(seed), run_id="paper", group_id="g", config=config)
    rows = []
    for label, cap in (("before cap", 10**6), (f"after cap (K={k})", k)):
        s = TrajectoryProcessor(ProcessorConfig(max_trajectories_per_run=cap,
                                                pack="none")).process([run]).stats
        rows.append({"stage": label, "trajectories": s.trajectories_kept,
                     "total_tokens": s.total_tokens, "unique_tokens": s.unique_tokens,
                     "trained_tokens": s.trainable_tokens,
                     "trajectory_trainable_tokens": s.trajectory_trainable_tokens,
                     "dedup_ratio": s.dedup_ratio})
    return rows


def train_config(smoke: bool) -> tuple[SyntheticConfig, TinyModelConfig, int]:
    if smoke:
        return (SyntheticConfig(num_calls=8, vocab_size=512, system_tokens=32, task_tokens=16,
                                tool_tokens_mean=12, output_tokens_mean=8, context_budget=150,
                                summary_tokens=8, num_subagents=1, subagent_calls=2,
                                num_retries=2, timeout_prob=0.0, failed_prob=0.0),
                TinyModelConfig(vocab_size=512, hidden_size=128, num_heads=2, num_kv_heads=1,
                                intermediate_size=256, num_layers=1), 2)
    return (SyntheticConfig(num_calls=40, vocab_size=4096, system_tokens=300, task_tokens=200,
                            tool_tokens_mean=40, output_tokens_mean=30, tail_sigma=0.6,
                            context_budget=1400, summary_tokens=40, num_subagents=1,
                            subagent_calls=4, num_retries=3, timeout_prob=0.0, failed_prob=0.0),
            TinyModelConfig(vocab_size=4096, hidden_size=256, num_heads=4, num_kv_heads=2,
                            intermediate_size=1024, num_layers=2, max_position_embeddings=8192),
            4)


def bench_train_step(seed: int, smoke: bool, device: str, repeats: int,
                     tree_attn: str | None = None) -> dict:
    wl, mc, runs_per_group = train_config(smoke)
    runs = synthetic_runs(seed, groups=2, runs_per_group=runs_per_group, config=wl)
    tree_impl = tree_attn or ("flex_attention" if device == "cuda" else "xlong_tree")
    flat_impl = "sdpa"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    batches = {layout: TrajectoryProcessor(ProcessorConfig(pack=layout, row_tokens=None))
               .process(runs) for layout in ("tree", "per_trajectory")}
    stats = batches["tree"].stats
    models = {"tree": tiny_causal_lm(mc, seed=seed, dtype=dtype,
                                     attn_implementation=tree_impl).to(device),
              "per_trajectory": tiny_causal_lm(mc, seed=seed, dtype=dtype,
                                               attn_implementation=flat_impl).to(device)}

    def step(layout: str) -> float:
        model = models[layout]
        model.zero_grad(set_to_none=True)
        total = 0.0
        for micro in micro_batches(batches[layout].packed, max_tokens=1):   # a sequence each
            loss, _ = policy_loss(token_logprobs(model, micro), micro, LossConfig())
            loss.backward()
            total += float(loss.detach())
        if device == "cuda":
            torch.cuda.synchronize()
        return total

    losses = {layout: step(layout) for layout in models}                    # warm-up
    samples = {layout: [] for layout in models}
    for _ in range(repeats):                          # interleaved: load drifts hit both alike
        for layout in models:
            samples[layout].extend(_timed(lambda: step(layout), 1))
    seconds = {layout: statistics.median(times) for layout, times in samples.items()}
    bound = stats.total_tokens / stats.unique_tokens
    speedup = seconds["per_trajectory"] / seconds["tree"]
    return {"device": device, "model": dataclasses.asdict(mc), "runs": len(runs),
            "trajectories": stats.trajectories_kept, "total_tokens": stats.total_tokens,
            "unique_tokens": stats.unique_tokens, "trained_tokens": stats.trainable_tokens,
            "tree_s": seconds["tree"], "per_trajectory_s": seconds["per_trajectory"],
            "speedup": speedup, "bound": bound, "ratio_to_bound": speedup / bound,
            "loss_tree": losses["tree"], "loss_per_trajectory": losses["per_trajectory"],
            "attn": {"tree": tree_impl, "per_trajectory": flat_impl}}


def _timed(fn, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return out


def print_tables(result: dict) -> None:
    p = result["paper_run"]
    tb = p["token_bytes"]
    print(f"\n## 1. Paper-scale run ({p['calls']} calls, context to {p['max_context']:,} tokens, "
          f"{p['trajectories']} trajectories)\n")
    print("| stage | wall s | × compare limit | peak MB | peak ÷ token bytes |")
    print("|---|---|---|---|---|")
    for pack, label in (("none", "assemble + select + tree + weights"),
                        ("tree", "… + pack (tree tensors)")):
        s, m = p[f"process_{pack}_s"], p[f"process_{pack}_peak_bytes"]
        print(f"| {label} | {s:.3f} | {s / p['compare_s']:.1f} | {m / 1e6:.1f} | {m / tb:.2f} |")
    print(f"\ntoken bytes (distinct buffers) {tb / 1e6:.1f} MB; input bytes as sent "
          f"{p['input_bytes_as_sent'] / 1e6:,.0f} MB; compare limit {p['compare_s'] * 1e3:.2f} ms")
    print("\n## 2. Dedup\n")
    print("| stage | trajectories | Σ trajectory tokens | unique tokens | trained tokens | "
          "dedup ratio |")
    print("|---|---|---|---|---|---|")
    for r in result["dedup"]:
        print(f"| {r['stage']} | {r['trajectories']} | {r['total_tokens']:,} | "
              f"{r['unique_tokens']:,} | {r['trained_tokens']:,} | {r['dedup_ratio']:.2f} |")
    for t in result["train_steps"]:
        print(f"\n## Training step on {t['device']} ({t['runs']} runs, {t['trajectories']} "
              f"trajectories, attn tree={t['attn']['tree']} / per-traj="
              f"{t['attn']['per_trajectory']})\n")
        print("| layout | tokens computed | step s | speedup | bound | ratio to bound |")
        print("|---|---|---|---|---|---|")
        print(f"| per_trajectory | {t['total_tokens']:,} | {t['per_trajectory_s']:.3f} | 1.00 | "
              f"| |")
        print(f"| tree | {t['unique_tokens']:,} | {t['tree_s']:.3f} | {t['speedup']:.2f} | "
              f"{t['bound']:.2f} | {t['ratio_to_bound']:.2f} |")


def main(argv: list[str] | None = None) -> dict:
    parser = bench_parser(__doc__)
    parser.add_argument("--device", default="cpu", help="cpu | cuda (adds a GPU step)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-trajectories", type=int, default=5)
    parser.add_argument("--dense", action="store_true",
                        help="also time the tree layout with a dense sdpa mask")
    args = parser.parse_args(argv)
    torch.manual_seed(args.seed)
    paper = SyntheticConfig.small() if args.smoke else SyntheticConfig.paper()
    if args.smoke:
        paper = dataclasses.replace(paper, timeout_prob=0.0, failed_prob=0.0)
    repeats = 1 if args.smoke else args.repeats
    result = {"seed": args.seed, "smoke": args.smoke,
              "paper_run": bench_paper_run(args.seed, paper, repeats),
              "dedup": dedup_rows(args.seed, paper, args.max_trajectories),
              "train_steps": [bench_train_step(args.seed, args.smoke, "cpu", repeats)]}
    if args.dense:
        result["train_steps"].append(bench_train_step(args.seed, args.smoke, "cpu", repeats,
                                                      tree_attn="sdpa"))
    if args.device == "cuda":
        result["train_steps"].append(bench_train_step(args.seed, args.smoke, "cuda", repeats))
    return finish(result, show=print_tables, json_path=args.json)


if __name__ == "__main__":
    main()
