"""Gradient reduction across training cells, side by side: who fetches what, and how long.

``n`` member actors each hold one gradient of ``P`` fp32 values; one step's reduction ends when
every member holds ``Σ g`` (what ``apply_step`` needs). Schemes (``ray_xlong.cells.reduce``)::

    all      every member fetches every gradient and sums        n·P bytes in per member
    tree     binary tree of _add tasks, members fetch the sum     P in per member
    leader   one _add task over all n, members fetch the sum      P in per member, n·P leader
    gloo     a gloo process group built for this membership, all_reduce; "build" is what a
             membership change costs (the elastic step's members change every step)

Schemes are interleaved per repeat and the median is reported (the machine is shared: read
the ratios, not the seconds).

    python benchmarks/grad_reduce.py --seed 0 --members 4 --mb 64 --json out.json
    python benchmarks/grad_reduce.py --smoke
"""

from __future__ import annotations

import pathlib
import statistics
import sys
import time

import ray
import torch

from ray_xlong.cells.reduce import reduce_gradients, traffic_per_member


sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # benchmarks.tools
from benchmarks.tools.entry import bench_parser, finish  # noqa: E402


class Member:
    """One training cell's gradient (and, for ``gloo``, its rank in a fresh process group)."""

    def __init__(self, *, seed: int, values: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.grad = {f"w{i}": torch.randn(values // 4, generator=gen) for i in range(4)}

    def take(self) -> dict[str, torch.Tensor]:
        return self.grad

    def apply(self, parts: list) -> float:
        parts = [ray.get(p) if isinstance(p, ray.ObjectRef) else p for p in parts]
        total = sum(float(sum(t.sum() for t in p.values())) for p in parts)
        return total

    def address(self) -> tuple[str, int]:
        from ray.train._internal.utils import get_address_and_port

        return get_address_and_port()

    def gloo(self, addr: str, port: int, rank: int, world: int) -> tuple[float, float]:
        import torch.distributed as dist
        from ray.train.torch.config import _setup_torch_process_group

        t0 = time.perf_counter()
        _setup_torch_process_group("gloo", rank, world, f"tcp://{addr}:{port}", 60)
        t1 = time.perf_counter()
        for t in self.grad.values():
            out = t.clone()
            dist.all_reduce(out)
        t2 = time.perf_counter()
        dist.destroy_process_group()
        return t1 - t0, t2 - t1


def one_round(members: list, scheme: str) -> dict[str, float]:
    t0 = time.perf_counter()
    if scheme == "gloo":
        addr, port = ray.get(members[0].address.remote())
        times = ray.get([m.gloo.remote(addr, port, r, len(members))
                         for r, m in enumerate(members)])
        return {"total_s": time.perf_counter() - t0, "build_s": max(t[0] for t in times),
                "reduce_s": max(t[1] for t in times)}
    parts = reduce_gradients([m.take.remote() for m in members], scheme=scheme)
    sums = ray.get([m.apply.remote(parts) for m in members])
    assert max(sums) - min(sums) <= 1e-3 * max(1.0, abs(sums[0]))
    return {"total_s": time.perf_counter() - t0}


def bench(*, seed: int, members: int, mb: float, repeats: int) -> dict:
    values = int(mb * 1e6 / 4) // 4 * 4
    actors = [ray.remote(Member).options(num_cpus=0).remote(seed=seed + i, values=values)
              for i in range(members)]
    ray.get([a.take.remote() for a in actors])
    schemes = ("all", "tree", "leader", "gloo")
    runs: dict[str, list[dict]] = {s: [] for s in schemes}
    for _ in range(repeats):
        for s in schemes:
            runs[s].append(one_round(actors, s))
    nbytes = values * 4
    out = {"members": members, "gradient_mb": nbytes / 1e6, "repeats": repeats, "schemes": {}}
    for s in schemes:
        row = {k: statistics.median(r[k] for r in runs[s]) for k in runs[s][0]}
        if s != "gloo":
            row.update({f"{k}_mb": v / 1e6 for k, v in traffic_per_member(
                scheme=s, members=members, parts=members, nbytes=nbytes).items()})
        else:
            row.update({"member_mb": 2 * nbytes / 1e6 * (members - 1) / members,
                        "reducer_mb": 0.0})   # ring all_reduce: 2(n-1)/n · P in per rank
        out["schemes"][s] = row
    base = out["schemes"]["all"]["total_s"]
    for row in out["schemes"].values():
        row["vs_all"] = row["total_s"] / base
    for a in actors:
        ray.kill(a)
    return out


def print_table(result: dict) -> None:
    print(f"\n{result['members']} members × {result['gradient_mb']:.1f} MB gradient, median of "
          f"{result['repeats']} (shared machine: read the ratios)\n")
    print("| scheme | total s | ÷ all | in per member MB | busiest reducer MB | gloo build s |")
    print("|---|---|---|---|---|---|")
    for s, r in result["schemes"].items():
        print(f"| {s} | {r['total_s']:.3f} | {r['vs_all']:.2f} | {r['member_mb']:.1f} | "
              f"{r['reducer_mb']:.1f} | {r.get('build_s', float('nan')):.3f} |")


def main(argv: list[str] | None = None) -> dict:
    parser = bench_parser(__doc__)
    parser.add_argument("--members", type=int, default=4)
    parser.add_argument("--mb", type=float, default=64.0, help="gradient size (MB)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, object_store_memory=600 * 1024 ** 2, include_dashboard=False)
    try:
        result = bench(seed=args.seed, members=3 if args.smoke else args.members,
                       mb=1.0 if args.smoke else args.mb,
                       repeats=1 if args.smoke else args.repeats)
    finally:
        if started:
            ray.shutdown()
    return finish(result, show=print_table, json_path=args.json)


if __name__ == "__main__":
    main()
