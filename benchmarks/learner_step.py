"""The product Learner's training step, tree-packed vs per-trajectory, side by side.

Not a side path: each variant is an ``XLongLearner`` built the way a cell builds it
(``rllib.learner.learner_config`` from ``LearnerSettings``), fed what a cell's learner gets: the
runs processed where they ended (``per_run.process_run``, outside the timing, as on a rollout
cell) and the micro-batch plan of the elastic step (``cells.learner_group.plan_step``); one whole
step is timed::

    accumulate_runs(micro) × k ─► take_gradients ─► apply_step
      (Learner connector pipeline: PrefixTreeConnector packs the runs ─► forward + backward)

| variant          | pack           | ``LearnerSettings.attn_implementation``                  |
|------------------|----------------|----------------------------------------------------------|
| per_trajectory   | per_trajectory | default (None: HF sdpa on per-trajectory rows)           |
| tree             | tree           | default (None: ``xlong_tree``, segments, no dense mask)  |
| tree_dense       | tree           | ``"sdpa"`` (dense tree masks; ``--dense``, a reference)  |

Speedup = per-trajectory step ÷ tree step; bound = Σ trajectory tokens ÷ unique tree tokens
(docs/design.md performance model). Variants are interleaved per repeat (load drift hits all alike)
and the median is reported. The first step's gradients of the tree and per-trajectory learners
(same weights) are compared: the same update (docs/design.md invariant 4).

    python benchmarks/learner_step.py --seed 0 --json out.json [--dense]
    python benchmarks/learner_step.py --smoke                    # tiny budget (CI)
"""

from __future__ import annotations

import dataclasses
import pathlib
import statistics
import sys
import tempfile
import time

import torch

from ray_xlong.cells.config import LearnerSettings
from ray_xlong.cells.learner_group import plan_step
from ray_xlong.models import TinyModelConfig, build_tiny_model_dir
from ray_xlong.rllib.episodes import run_to_episode
from ray_xlong.rllib.learner import XLongLearner, learner_config
from ray_xlong.trajectory import ProcessorConfig
from ray_xlong.trajectory.per_run import process_run
from ray_xlong.trajectory.synthetic import SyntheticConfig, synthetic_runs


sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # benchmarks.tools
from benchmarks.tools.entry import bench_parser, finish  # noqa: E402

VARIANTS = {"per_trajectory": ("per_trajectory", None), "tree": ("tree", None),
            "tree_dense": ("tree", "sdpa")}
"""Variant → (pack, ``LearnerSettings.attn_implementation``)."""


def sizes(smoke: bool) -> tuple[SyntheticConfig, TinyModelConfig, int]:
    """(workload, model, runs per group): the tiny-model step of ``trajectory_processor.py``."""
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


class Step:
    """One variant: a built product Learner and the micro-batches of its layout."""

    def __init__(self, model_dir: str, runs, *, pack: str, attn: str | None,
                 micro_batch_tokens: int, seed: int) -> None:
        self.settings = LearnerSettings(model_dir=model_dir, attn_implementation=attn,
                                        micro_batch_tokens=micro_batch_tokens)
        processor = ProcessorConfig(pack=pack, row_tokens=None)
        config, spec = learner_config(self.settings, seed=seed, processor=processor)
        self.learner = XLongLearner(config=config, module_spec=spec)
        self.learner.build()
        processed = [process_run(r, processor) for r in runs]
        self.payload = [run_to_episode(r, processed=p) for r, p in zip(runs, processed)]
        self.micro, self.stats = plan_step([p.digest for p in processed], processor=processor,
                                           max_tokens=micro_batch_tokens)
        self.total = sum(m.weight for m in self.micro)

    def gradients(self) -> dict[str, torch.Tensor]:
        """Accumulate every micro-batch; the summed gradient (no optimizer step)."""
        for m in self.micro:
            self.learner.accumulate_runs(m.run_ids, m.advantages, self.learner.version,
                                         self.payload)
        return self.learner.take_gradients()

    def run(self) -> float:
        """One full step (accumulate × k, take_gradients, apply_step); returns seconds."""
        start = time.perf_counter()
        grads = self.gradients()
        self.learner.apply_step([grads], self.total, self.learner.version + 1)
        return time.perf_counter() - start


def grad_rel_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """max over parameters of ‖a − b‖ ÷ max(‖b‖, tiny)."""
    return max(float((a[k] - b[k]).norm() / b[k].norm().clamp_min(1e-30)) for k in b)


def bench(seed: int, *, smoke: bool, repeats: int, dense: bool,
          micro_batch_tokens: int) -> dict:
    wl, mc, runs_per_group = sizes(smoke)
    runs = synthetic_runs(seed, groups=2, runs_per_group=runs_per_group, config=wl)
    model_dir = str(build_tiny_model_dir(tempfile.mkdtemp(prefix="xlong_step_"), seed=seed,
                                         config=mc))
    names = [n for n in VARIANTS if dense or n != "tree_dense"]
    steps = {n: Step(model_dir, runs, pack=VARIANTS[n][0], attn=VARIANTS[n][1],
                     micro_batch_tokens=micro_batch_tokens, seed=seed) for n in names}
    grads = {n: steps[n].gradients() for n in ("tree", "per_trajectory")}     # also a warm-up
    samples = {n: [] for n in names}
    for _ in range(repeats):
        for n in names:
            samples[n].append(steps[n].run())
    seconds = {n: statistics.median(t) for n, t in samples.items()}
    stats = steps["tree"].stats
    bound = stats.total_tokens / stats.unique_tokens
    rows = {n: {"pack": VARIANTS[n][0],
                "attn": steps[n].learner.lm.config._attn_implementation,
                "step_s": seconds[n], "micro_batches": len(steps[n].micro),
                "speedup": seconds["per_trajectory"] / seconds[n]} for n in names}
    for n in names:
        rows[n]["ratio_to_bound"] = rows[n]["speedup"] / bound
    return {"seed": seed, "smoke": smoke, "model": dataclasses.asdict(mc), "runs": len(runs),
            "micro_batch_tokens": micro_batch_tokens, "repeats": repeats,
            "trajectories": stats.trajectories_kept, "total_tokens": stats.total_tokens,
            "unique_tokens": stats.unique_tokens, "bound": bound, "variants": rows,
            "grad_rel_diff": grad_rel_diff(grads["tree"], grads["per_trajectory"])}


def print_table(result: dict) -> None:
    print(f"\n## Product Learner step ({result['runs']} runs, {result['trajectories']} "
          f"trajectories, micro_batch_tokens={result['micro_batch_tokens']}, median of "
          f"{result['repeats']})\n")
    print("| variant | attention | micro-batches | step s | speedup | bound | ratio to bound |")
    print("|---|---|---|---|---|---|---|")
    for name, r in result["variants"].items():
        print(f"| {name} | {r['attn']} | {r['micro_batches']} | {r['step_s']:.3f} | "
              f"{r['speedup']:.2f} | {result['bound']:.2f} | {r['ratio_to_bound']:.2f} |")
    print(f"\nΣ trajectory tokens {result['total_tokens']:,}, unique {result['unique_tokens']:,};"
          f" tree vs per-trajectory gradient rel. diff {result['grad_rel_diff']:.1e}")


def main(argv: list[str] | None = None) -> dict:
    parser = bench_parser(__doc__)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dense", action="store_true",
                        help="also time tree batches with dense sdpa masks")
    parser.add_argument("--micro-batch-tokens", type=int, default=4096,
                        help="LearnerSettings.micro_batch_tokens (1: one sequence per forward)")
    args = parser.parse_args(argv)
    torch.manual_seed(args.seed)
    result = bench(args.seed, smoke=args.smoke, repeats=1 if args.smoke else args.repeats,
                   dense=args.dense, micro_batch_tokens=args.micro_batch_tokens)
    return finish(result, show=print_table, json_path=args.json)


if __name__ == "__main__":
    main()
