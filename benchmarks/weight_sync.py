"""Seconds per GB to move new weights from a Learner to several engines, side by side.

One sender actor (the training cell's rank 0) holds a state dict of ``--mb`` MB; ``--engines``
receiver actors (engines of rollout cells) must each end up holding it::

    object_store   ray.put once on the sender, every receiver ray.get's it (today's CPU path)
    gloo_buckets   cells/weight_sync.py: bucket plan, one broadcast per bucket over a gloo
                   group of sender + receivers (built once, not timed)
    nccl_buckets   (``--device cuda``) the same over NCCL, one GPU per peer (needs engines + 1
                   GPUs: NCCL refuses two ranks on one device); unverified, no GPU here

Interleaved per repeat, median reported; the machine is shared, read the ratio.

    python benchmarks/weight_sync.py --seed 0 --mb 256 --engines 2 --json out.json
    python benchmarks/weight_sync.py --smoke
    python benchmarks/weight_sync.py --device cuda --mb 1024 --engines 1
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import ray
import torch

from ray_xlong.cells.weight_sync import bucket_plan, receive, send


class Peer:
    """Sender (rank 0) or receiver of the weights."""

    def __init__(self, *, seed: int, mb: float, rank: int, device: str = "cpu") -> None:
        gen = torch.Generator().manual_seed(seed)
        n = int(mb * 1e6 / 4 / 8)
        self.device = device
        self.sd = {f"layer{i}.weight": torch.randn(n, generator=gen).to(device)
                   for i in range(8)}
        self.rank = rank

    def address(self) -> tuple[str, int]:
        from ray.train._internal.utils import get_address_and_port

        return get_address_and_port()

    def join(self, addr: str, port: int, world: int) -> int:
        from ray.train.torch.config import _setup_torch_process_group

        backend = "nccl" if self.device == "cuda" else "gloo"
        if self.device == "cuda":
            torch.cuda.set_device(0)
        _setup_torch_process_group(backend, self.rank, world, f"tcp://{addr}:{port}", 120)
        return self.rank

    def put(self) -> list:
        return [ray.put(self.sd)]

    def fetch(self, refs: list) -> float:
        got = ray.get(refs[0])
        return float(next(iter(got.values()))[0])

    def bcast(self, bucket_mb: float) -> float:
        plan = bucket_plan(self.sd, bucket_mb=bucket_mb)
        if self.rank == 0:
            send(self.sd, plan, device=self.device)
            return float(next(iter(self.sd.values()))[0])
        got = {}
        for part in receive(plan, device=self.device):
            got.update(part)
        if self.device == "cuda":
            torch.cuda.synchronize()
        return float(next(iter(got.values()))[0])


def bench(*, seed: int, mb: float, engines: int, repeats: int, bucket_mb: float,
          device: str = "cpu") -> dict:
    gpus = 1 if device == "cuda" else 0
    peers = [ray.remote(Peer).options(num_cpus=0, num_gpus=gpus).remote(
        seed=seed, mb=mb, rank=r, device=device) for r in range(engines + 1)]
    buckets = "nccl_buckets" if device == "cuda" else "gloo_buckets"
    addr, port = ray.get(peers[0].address.remote())
    ray.get([p.join.remote(addr, port, len(peers)) for p in peers])
    gb = mb / 1e3
    samples: dict[str, list[float]] = {"object_store": [], buckets: []}
    for _ in range(repeats):
        t0 = time.perf_counter()
        refs = ray.get(peers[0].put.remote())
        firsts = ray.get([p.fetch.remote(refs) for p in peers[1:]])
        samples["object_store"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        firsts2 = ray.get([p.bcast.remote(bucket_mb) for p in peers])
        samples[buckets].append(time.perf_counter() - t0)
        assert len(set(firsts)) == 1 and len(set(firsts2)) == 1 and firsts[0] == firsts2[0]
        del refs
    out = {"mb": mb, "engines": engines, "bucket_mb": bucket_mb, "repeats": repeats,
           "device": device, "schemes": {}}
    for name, t in samples.items():
        s = statistics.median(t)
        out["schemes"][name] = {"seconds": s, "s_per_gb": s / gb,
                                "s_per_gb_per_engine": s / gb / engines}
    base = out["schemes"]["object_store"]["seconds"]
    for row in out["schemes"].values():
        row["vs_object_store"] = row["seconds"] / base
    for p in peers:
        ray.kill(p)
    return out


def print_table(result: dict) -> None:
    print(f"\n{result['mb']:.0f} MB of weights to {result['engines']} engines (buckets of "
          f"{result['bucket_mb']:g} MB), median of {result['repeats']}; shared machine\n")
    print("| scheme | s | s/GB | s/GB per engine | ÷ object store |")
    print("|---|---|---|---|---|")
    for name, r in result["schemes"].items():
        print(f"| {name} | {r['seconds']:.3f} | {r['s_per_gb']:.2f} | "
              f"{r['s_per_gb_per_engine']:.2f} | {r['vs_object_store']:.2f} |")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument("--smoke", action="store_true", help="tiny budget (CI)")
    parser.add_argument("--mb", type=float, default=256.0)
    parser.add_argument("--engines", type=int, default=2)
    parser.add_argument("--bucket-mb", type=float, default=64.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cuda: NCCL broadcast, one GPU per peer")
    args = parser.parse_args(argv)
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2 if args.device == "cpu" else None,
                 object_store_memory=800 * 1024 ** 2, include_dashboard=False)
    try:
        result = bench(seed=args.seed, mb=4.0 if args.smoke else args.mb,
                       engines=args.engines, repeats=1 if args.smoke else args.repeats,
                       bucket_mb=1.0 if args.smoke else args.bucket_mb, device=args.device)
    finally:
        if started:
            ray.shutdown()
    print_table(result)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
