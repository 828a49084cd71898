"""The trajectory processor alone (no Ray): synthetic agent runs → trees → a training batch.

    python examples/trajectory_connector_alone.py [--paper] [--seed 0]

Prints one run's calls grouped into trajectories, its prefix tree (``>`` marks trainable,
model-generated tokens), the batch stats, and one PPO loss on a tiny local model in both layouts
(the same number: tree packing changes the cost, not the math).
"""

from __future__ import annotations

import argparse
import time

import torch

from ray_xlong.models import TinyModelConfig, tiny_causal_lm
from ray_xlong.trajectory import (LossConfig, ProcessorConfig, TrajectoryProcessor, assemble,
                                  policy_loss)
from ray_xlong.trajectory.model import token_logprobs
from ray_xlong.trajectory.synthetic import SyntheticConfig, synthetic_runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--paper", action="store_true",
                        help="one paper-scale run (636 calls, ~700k-token context)")
    args = parser.parse_args()

    if args.paper:
        runs = synthetic_runs(args.seed, groups=1, runs_per_group=1,
                              config=SyntheticConfig.paper())
    else:
        config = SyntheticConfig(num_calls=14, vocab_size=200, system_tokens=6, task_tokens=4,
                                 tool_tokens_mean=5, output_tokens_mean=4, context_budget=70,
                                 summary_tokens=4, num_subagents=1, subagent_calls=2,
                                 num_retries=1, timeout_prob=0.25, failed_prob=0.1)
        runs = synthetic_runs(args.seed, groups=2, runs_per_group=4, config=config)
    run = max((r for r in runs if r.status != "failed"), key=lambda r: len(r.calls))

    print(f"# {run!r}\n")
    for t in assemble(run):
        print(f"  {t!r}  rank={t.rank}")
    start = time.perf_counter()
    batch = TrajectoryProcessor(ProcessorConfig(max_trajectories_per_run=5, pack="tree")).process(
        runs)
    elapsed = time.perf_counter() - start
    print()
    batch.trees[run.run_id].pretty_print()
    print(f"\n# batch of {len(runs)} runs processed in {elapsed * 1e3:.1f} ms")
    for field, value in batch.stats.__class__.__dataclass_fields__.items():
        print(f"  {field:28s} {getattr(batch.stats, field)}")
    print(f"  {'dedup_ratio':28s} {batch.stats.dedup_ratio:.2f}")

    if not args.paper:
        model = tiny_causal_lm(TinyModelConfig(vocab_size=200), seed=args.seed,
                               dtype=torch.float64, attn_implementation="xlong_tree")
        print("\n# one PPO loss on a tiny local model (fp64), both layouts:")
        for layout in ("tree", "per_trajectory"):
            packed = TrajectoryProcessor(ProcessorConfig(pack=layout)).process(runs).packed
            loss, stats = policy_loss(token_logprobs(model, packed), packed, LossConfig())
            print(f"  {layout:15s} positions={packed.num_positions:5d} targets="
                  f"{packed.num_targets:4d} loss={loss.item():.12f}")


if __name__ == "__main__":
    main()
