"""One long tree row on 1, 2 and 4 context-parallel ranks: memory per rank, step time, exactness.

Each configuration starts ``ranks`` fresh processes (gloo) that build a sharded cell Learner
(``cells.sharded.LearnerRank``: FSDP2 over the ranks, ``LearnerSettings.context_parallel =
ranks``; ``--exchange spans all ring`` runs each K/V exchange) and train one step on the same
tree of ``tokens`` tokens — one run's tree, one row::

    trunk (system prompt, seen by all) ─► compaction segments of --segment tokens, each a
    chain of turns (environment tokens, then model tokens: the targets) with a retry branch
    from its middle                       position = depth, kv_end = subtree end

A rank's peak memory is its resident set sampled every 2 ms during the step, minus the
resident set before it (the model, the batch and the libraries are there before). The 1-rank
run is the reference: logprobs (every target) and the cell's summed gradient of the others are
compared with it (max abs difference; gradients also relative to each tensor's largest entry).
The split-KV plan of the row is reported too (pieces, prefix ranges, host bytes, the largest
gathered prefix), against the bytes a dense bf16 L² mask would take, and the chunked head:
peak memory of target logprobs (forward + backward) at ``--logprob-targets`` × ``--vocab``.

    python benchmarks/long_context.py --json out.json                 # 128k, 512k, 1M
    python benchmarks/long_context.py --quick --json out.json         # CI: tiny sizes
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import resource
import socket
import sys
import tempfile
import threading
import time

import numpy as np
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # benchmarks.tools
from benchmarks.tools.entry import bench_parser, finish  # noqa: E402

MODEL = dict(vocab_size=512, hidden_size=64, num_layers=1, num_heads=1, num_kv_heads=1,
             intermediate_size=128, max_position_embeddings=1 << 21)
"""The tiny model (head_dim 64)."""


@dataclasses.dataclass(frozen=True, slots=True)
class TreeShape:
    """The synthetic tree of one long run."""

    tokens: int
    """Tokens of the row."""
    trunk: int = 512
    """System prompt tokens every segment sees."""
    segment: int = 4096
    """Tokens per compaction segment (a chain with one retry branch)."""
    turn: int = 64
    """Tokens per turn (half environment, half model output)."""
    vocab: int = 512
    """Token ids drawn from [0, vocab)."""


def tree_row(shape: TreeShape, seed: int):
    """The one-row tree ``PackedBatch`` (deterministic per seed)."""
    from ray_xlong.trajectory.packing import PackedBatch

    n, rng = shape.tokens, np.random.default_rng(seed)
    kv_end = np.full(n, n, dtype=np.int64)
    depth = np.arange(n, dtype=np.int64)
    parent = np.arange(n, dtype=np.int64) - 1
    trunk = min(shape.trunk, n // 2)
    for a in range(trunk, n, shape.segment):
        b = min(a + shape.segment, n)
        main = a + (b - a) * 3 // 4               # [a, mid) shared · [mid, main) · [main, b) retry
        mid = a + (b - a) // 2
        kv_end[a:mid], kv_end[mid:main], kv_end[main:b] = b, main, b
        parent[a] = trunk - 1
        depth[a:main] = trunk + np.arange(main - a)
        if main < b:
            parent[main] = mid - 1
            depth[main:b] = trunk + (mid - a) + np.arange(b - main)
    trainable = (np.arange(n) % shape.turn) >= shape.turn // 2
    trainable[:trunk] = False
    cols = np.flatnonzero(trainable)
    t = cols.size
    ids = torch.from_numpy(rng.integers(0, shape.vocab, n))
    return PackedBatch("tree", ids.unsqueeze(0), torch.from_numpy(depth).unsqueeze(0),
                       torch.from_numpy(kv_end).unsqueeze(0), torch.zeros(t, dtype=torch.int64),
                       torch.from_numpy(parent[cols]), ids[cols],
                       torch.full((t,), -6.2), torch.zeros(t, dtype=torch.int64),
                       torch.from_numpy(rng.choice([-1.0, 1.0], t).astype(np.float32)),
                       torch.full((t,), 1.0 / t), torch.zeros(t, dtype=torch.int64), ("run",),
                       torch.ones(1, n, dtype=torch.bool))


class PeakRSS:
    """Resident-set high-water mark of this process, sampled on a thread."""

    def __init__(self, every_s: float = 0.002) -> None:
        self.every_s, self.peak, self.stop = every_s, 0, threading.Event()
        self.base = self.rss()

    @staticmethod
    def rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def __enter__(self) -> "PeakRSS":
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        return self

    def _run(self) -> None:
        while not self.stop.is_set():
            self.peak = max(self.peak, self.rss())
            time.sleep(self.every_s)

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()
        self.peak = max(self.peak, self.rss())

    @property
    def delta(self) -> int:
        return self.peak - self.base


def _rank(rank: int, ranks: int, shape: TreeShape, seed: int, model_dir: str, port: int,
          out: str, exchange: str) -> None:
    """One rank: build the Learner, train one step on its share, save what it measured."""
    from ray_xlong.cells.config import LearnerSettings
    from ray_xlong.cells.context_parallel import rank_share
    from ray_xlong.cells.sharded import LearnerRank, rank_rows
    from ray_xlong.cells.sharding import ShardingSettings
    from ray_xlong.trajectory.loss import policy_loss

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // ranks))
    learner = LearnerRank(settings=LearnerSettings(model_dir=model_dir, context_parallel=ranks),
                          sharding=ShardingSettings(ranks_per_cell=ranks, timeout_s=7200.0),
                          rank=rank, world_size=ranks)
    learner.setup("127.0.0.1", port)
    batch = tree_row(shape, seed)
    if ranks > 1:
        local, plan, _ = rank_share(batch, rank=rank, world_size=ranks, context_parallel=ranks,
                                    group=learner.cp_group, exchange=exchange)
        offset = plan.start
    else:
        (local, _), plan, offset = rank_rows(batch, rank=0, world_size=1), None, 0
    with PeakRSS() as peak:
        start = time.perf_counter()
        logprobs = learner.root(local.to_tensors(), plan)
        loss, _ = policy_loss(logprobs, local)
        loss.backward()
        grads = learner.take_gradients()
        seconds = time.perf_counter() - start
    torch.save({"peak": peak.delta, "seconds": seconds, "logprobs": logprobs.detach(),
                "src": local.target_src + offset, "grads": grads}, f"{out}/rank{rank}.pt")


def train(shape: TreeShape, ranks: int, *, seed: int, model_dir: str, work: str,
          exchange: str = "ring") -> dict:
    """One configuration: its ranks' measurements, merged."""
    import torch.multiprocessing as mp

    out = tempfile.mkdtemp(dir=work)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_rank, args=(ranks, shape, seed, model_dir, port, out, exchange), nprocs=ranks)
    parts = [torch.load(f"{out}/rank{r}.pt") for r in range(ranks)]
    src = torch.cat([p["src"] for p in parts])
    logprobs = torch.cat([p["logprobs"] for p in parts])[torch.argsort(src)]
    return {"peaks": [p["peak"] for p in parts], "seconds": max(p["seconds"] for p in parts),
            "logprobs": logprobs, "grads": parts[0]["grads"]}


def plan_report(shape: TreeShape, seed: int) -> dict:
    """The split-KV plan of the row vs a dense bf16 mask."""
    from ray_xlong.trajectory.split_kv import split_kv_plan

    batch = tree_row(shape, seed)
    plan = split_kv_plan(batch.attention_mask, batch.valid)
    ranges = sum(len(p.prefix) for p in plan.pieces)
    gathered = max((p.num_prefix for p in plan.pieces if len(p.prefix) > 1), default=0)
    return {"tokens": shape.tokens, "pieces": len(plan.pieces), "prefix_ranges": ranges,
            "plan_host_bytes": 16 * ranges + 24 * len(plan.pieces),
            "largest_gathered_prefix_bytes_per_head": gathered * 64 * 2 * 2,
            "dense_bf16_mask_bytes": 2 * shape.tokens ** 2}


def _logprob_peak(targets: int, vocab: int, hidden: int, out: str) -> None:
    from ray_xlong.trajectory.chunked_logprobs import chunked_logprobs

    torch.manual_seed(0)
    head = torch.nn.Linear(hidden, vocab, bias=False)
    h = torch.randn(targets, hidden, requires_grad=True)
    ids = torch.randint(0, vocab, (targets,))
    with PeakRSS() as peak:
        start = time.perf_counter()
        chunked_logprobs(h, head, ids).sum().backward()
        seconds = time.perf_counter() - start
    torch.save({"peak": peak.delta, "seconds": seconds,
                "rss_max": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024},
               f"{out}/logprobs.pt")


def logprob_report(targets: int, vocab: int, *, work: str) -> dict:
    """Peak memory of the chunked head (forward + backward) in a fresh process."""
    import torch.multiprocessing as mp

    out = tempfile.mkdtemp(dir=work)
    mp.spawn(lambda_free_logprob, args=(targets, vocab, out), nprocs=1)
    r = torch.load(f"{out}/logprobs.pt")
    return {"targets": targets, "vocab": vocab, "hidden": 16, "peak_bytes": r["peak"],
            "seconds": r["seconds"], "unchunked_fp32_logits_bytes": 4 * targets * vocab}


def lambda_free_logprob(_: int, targets: int, vocab: int, out: str) -> None:
    """``mp.spawn`` entry of :func:`_logprob_peak` (hidden size 16)."""
    _logprob_peak(targets, vocab, 16, out)


def bench(*, seed: int, tokens: list[int], ranks: list[int], segment: int,
          logprob_targets: int, vocab: int, exchanges: list[str]) -> dict:
    """Every (tokens, ranks) configuration, the plan and the chunked head."""
    from ray_xlong.models import TinyModelConfig, tiny_causal_lm

    rows = []
    with tempfile.TemporaryDirectory(prefix="long_context") as work:
        model_dir = f"{work}/model"
        model = tiny_causal_lm(TinyModelConfig(**MODEL), seed=seed)
        with torch.no_grad():          # logits of O(1), not ≈ uniform: differences show
            for module in (model.get_input_embeddings(), model.get_output_embeddings()):
                module.weight.mul_(30.0)
        model.save_pretrained(model_dir)
        for n in tokens:
            shape = TreeShape(tokens=n, segment=min(segment, max(n // 4, 64)))
            base = None
            for r in ranks:
                for exchange in (exchanges if r > 1 else ["-"]):
                    res = train(shape, r, seed=seed, model_dir=model_dir, work=work,
                                exchange=exchange if r > 1 else "ring")
                    base = base or (res if r == 1 else None)
                    rows.append({**_row(n, r, res, base), "exchange": exchange})
        plans = [plan_report(TreeShape(tokens=n, segment=min(segment, max(n // 4, 64))), seed)
                 for n in tokens]
        logprobs = logprob_report(logprob_targets, vocab, work=work)
    return {"seed": seed, "model": MODEL, "segment": segment, "rows": rows, "plans": plans,
            "chunked_logprobs": logprobs, "load": os.getloadavg()}


def _row(tokens: int, ranks: int, res: dict, base: dict | None) -> dict:
    row = {"tokens": tokens, "ranks": ranks, "peak_bytes_per_rank": max(res["peaks"]),
           "step_s": res["seconds"], "max_abs_logprob_diff": None, "max_abs_grad_diff": None,
           "max_rel_grad_diff": None, "peak_ratio_vs_1_rank": None}
    if base is not None:
        row["max_abs_logprob_diff"] = float((res["logprobs"] - base["logprobs"]).abs().max())
        diffs = {k: (res["grads"][k] - g).abs().max() for k, g in base["grads"].items()}
        row["max_abs_grad_diff"] = float(max(diffs.values()))
        row["max_rel_grad_diff"] = float(max(d / max(base["grads"][k].abs().max(), 1e-30)
                                             for k, d in diffs.items()))
        row["peak_ratio_vs_1_rank"] = row["peak_bytes_per_rank"] / max(base["peaks"][0], 1)
    return row


def print_table(result: dict) -> None:
    print("\n## One tree row on context-parallel ranks (gloo, tiny model)\n")
    print("| tokens | ranks | K/V exchange | peak MB / rank | × 1 rank | step s | "
          "max abs Δ logprob | max abs Δ grad | max rel Δ grad |")
    print("|---|---|---|---|---|---|---|---|---|")
    fmt = lambda v, f: "—" if v is None else format(v, f)  # noqa: E731
    for r in result["rows"]:
        print(f"| {r['tokens']:,} | {r['ranks']} | {r['exchange']} | "
              f"{r['peak_bytes_per_rank'] / 2**20:,.0f} | "
              f"{fmt(r['peak_ratio_vs_1_rank'], '.2f')} | {r['step_s']:.1f} | "
              f"{fmt(r['max_abs_logprob_diff'], '.1e')} | {fmt(r['max_abs_grad_diff'], '.1e')} | "
              f"{fmt(r['max_rel_grad_diff'], '.1e')} |")
    print("\n| tokens | pieces | prefix ranges | plan host KB | largest gathered prefix KB/head "
          "| dense bf16 mask GB |")
    print("|---|---|---|---|---|---|")
    for p in result["plans"]:
        print(f"| {p['tokens']:,} | {p['pieces']} | {p['prefix_ranges']} | "
              f"{p['plan_host_bytes'] / 1024:.1f} | "
              f"{p['largest_gathered_prefix_bytes_per_head'] / 1024:.0f} | "
              f"{p['dense_bf16_mask_bytes'] / 2**30:.1f} |")
    c = result["chunked_logprobs"]
    print(f"\nChunked head: {c['targets']:,} targets × {c['vocab']:,} vocab (hidden "
          f"{c['hidden']}): peak {c['peak_bytes'] / 2**20:,.0f} MB in {c['seconds']:.1f} s "
          f"(unchunked fp32 logits alone: {c['unchunked_fp32_logits_bytes'] / 2**30:,.1f} GB). "
          f"Load average {result['load'][0]:.1f}.")


def main(argv: list[str] | None = None) -> dict:
    parser = bench_parser(__doc__)
    parser.add_argument("--quick", dest="smoke", action="store_true", help="tiny sizes (CI)")
    parser.add_argument("--tokens", type=int, nargs="+", default=None)
    parser.add_argument("--ranks", type=int, nargs="+", default=None)
    parser.add_argument("--segment", type=int, default=4096)
    parser.add_argument("--logprob-targets", type=int, default=None)
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--exchange", nargs="+", default=["ring"],
                        choices=["spans", "all", "ring"],
                        help="K/V exchange(s) of the context-parallel runs")
    args = parser.parse_args(argv)
    tokens = args.tokens or ([2048, 4096] if args.smoke else [131_072, 524_288, 1_048_576])
    ranks = args.ranks or ([1, 2] if args.smoke else [1, 2, 4])
    targets = args.logprob_targets or (2000 if args.smoke else 200_000)
    result = bench(seed=args.seed, tokens=tokens, ranks=sorted(ranks), segment=args.segment,
                   logprob_targets=targets, vocab=args.vocab, exchanges=args.exchange)
    return finish(result, show=print_table, json_path=args.json)


if __name__ == "__main__":
    main()
