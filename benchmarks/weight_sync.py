"""Seconds per GB to move new weights from a Learner to several engines, side by side.

One sender actor (the training cell's rank 0) holds a state dict of ``--mb`` MB; ``--engines``
receiver actors (engines of rollout cells) must each end up holding it::

    object_store   ray.put once on the sender, every receiver ray.get's it (today's CPU path)
    gloo_buckets   cells/weight_sync.py: bucket plan, one broadcast per bucket over a gloo
                   group of sender + receivers (built once, not timed)
    nccl_buckets   (``--device cuda``) the same over NCCL, one GPU per peer (needs engines + 1
                   GPUs: NCCL refuses two ranks on one device); unverified, no GPU here

``--through pool`` measures the job's own path instead: a real ``CellPool`` of ``engines + 1``
cells (cell 0's ``XLongLearner`` holds a model of about ``--mb`` MB; every other cell's runner
hosts the job's engine on the same model), the weights of one step pushed to every other
cell's engine as ``RayActuator._push_weights`` pushes them::

    object_store   learner.get_weights() ref → CellPool.push_weights (each runner fetches it
                   and loads it between engine batches)
    broadcast      cells/broadcast.py: learner.send_weights ║ runner.receive_weights over the
                   sync group (made on the first push, reported apart: not in the median;
                   so is a warm push that makes a new group), then the same load

Both include the learner's copy of its weights and the engines' load. Interleaved per repeat,
median reported; the machine is shared, read the ratio.

    python benchmarks/weight_sync.py --seed 0 --mb 256 --engines 2 --json out.json
    python benchmarks/weight_sync.py --through pool --seed 0 --mb 256 --engines 2
    python benchmarks/weight_sync.py --smoke [--through pool]
    python benchmarks/weight_sync.py --device cuda --mb 1024 --engines 1
"""

from __future__ import annotations

import pathlib
import statistics
import sys
import time

import ray
import torch

from ray_xlong.cells.weight_sync import bucket_plan, receive, send


sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # benchmarks.tools
from benchmarks.tools.entry import bench_parser, finish  # noqa: E402


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


def summarize(samples: dict[str, list[float]], *, gb: float, engines: int) -> dict:
    """Per scheme: median seconds, s/GB, s/GB per engine, and the ratio to the object store."""
    out = {}
    for name, t in samples.items():
        s = statistics.median(t)
        out[name] = {"seconds": s, "s_per_gb": s / gb, "s_per_gb_per_engine": s / gb / engines}
    for row in out.values():
        row["vs_object_store"] = row["seconds"] / out["object_store"]["seconds"]
    return out


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
           "device": device, "schemes": summarize(samples, gb=gb, engines=engines)}
    for p in peers:
        ray.kill(p)
    return out


def pool_model(path, *, seed: int, mb: float, smoke: bool):
    """A model directory of about ``mb`` MB (fp32): width 1024, as many layers as it takes
    (the default tiny model for ``smoke``)."""
    from ray_xlong.models import TinyModelConfig, build_tiny_model_dir

    if smoke:
        return str(build_tiny_model_dir(path, seed=seed))
    per_layer = 4 * (2 * 1024 * 1024 + 2 * 1024 * 64 + 3 * 1024 * 2816)    # bytes, fp32
    layers = max(1, round(mb * 1e6 / per_layer))
    return str(build_tiny_model_dir(path, seed=seed, config=TinyModelConfig(
        hidden_size=1024, num_heads=16, num_kv_heads=1, intermediate_size=2816,
        num_layers=layers)))


def bench_pool(*, seed: int, mb: float, engines: int, repeats: int, bucket_mb: float,
               smoke: bool = False) -> dict:
    """The job's push, both schemes, through a real ``CellPool`` (module docstring)."""
    import tempfile

    from ray_xlong.cells.broadcast import BroadcastWeights
    from ray_xlong.cells.config import LearnerSettings
    from ray_xlong.cells.long_horizon_job import LongHorizonJob
    from ray_xlong.cells.layout import CellLayout
    from ray_xlong.cells.pool import create_cells
    from ray_xlong.cells.sharding import model_num_params
    from ray_xlong.rllib.cell_actors import cell_actors
    from ray_xlong.rllib.env_runner import RolloutConfig

    model_dir = pool_model(tempfile.mkdtemp(prefix="ws"), seed=seed, mb=mb, smoke=smoke)
    gb = 4 * model_num_params(model_dir) / 1e9
    work = LongHorizonJob()
    actors = cell_actors(rollout=RolloutConfig(model_dir=model_dir,
                                               engine_factory=work.engine_factory(model_dir)),
                         learner=LearnerSettings(model_dir=model_dir), tasks=work.tasks(),
                         seed=seed)
    layout = CellLayout(cells=engines + 1, cpus_per_bundle=2 / (engines + 1), strategy="PACK")
    pool = create_cells(layout, actors=actors, ready_timeout_s=300)
    sync = BroadcastWeights(timeout_s=300, bucket_mb=bucket_mb)
    targets = list(range(1, engines + 1))
    samples: dict[str, list[float]] = {"object_store": [], "broadcast": []}
    try:
        def broadcast() -> float:
            out = sync.push(pool, sender=0, targets=targets, version=0, weights_ref=None)
            assert not out.lost and not out.fallback, out
            return out.seconds

        first = broadcast()                                  # makes the sync group
        for _ in range(repeats):
            t0 = time.perf_counter()
            ref = pool.cells[0].learner.get_weights.remote()
            assert pool.push_weights(targets, ref, 0) == []
            samples["object_store"].append(time.perf_counter() - t0)
            del ref
            samples["broadcast"].append(broadcast())
        sync.generation += 1                     # a warm push that must make a new group
        regroup = broadcast()
        want = ray.get(pool.cells[0].learner.get_weights.remote())
        for c in targets:                                    # what the last push delivered
            got = ray.get(pool.cells[c].runner.engine_weights.remote())[0]
            assert all(torch.equal(got[k], want[k]) for k in want), f"cell {c}"
    finally:
        pool.shutdown()
    return {"through": "pool", "mb": gb * 1e3, "engines": engines, "bucket_mb": bucket_mb,
            "repeats": repeats, "device": "cpu", "first_broadcast_s": first,
            "new_group_broadcast_s": regroup,
            "schemes": summarize(samples, gb=gb, engines=engines)}


def print_table(result: dict) -> None:
    where = " through a CellPool (the job's push)" if result.get("through") == "pool" else ""
    print(f"\n{result['mb']:.0f} MB of weights to {result['engines']} engines{where} (buckets "
          f"of {result['bucket_mb']:g} MB), median of {result['repeats']}; shared machine\n")
    print("| scheme | s | s/GB | s/GB per engine | ÷ object store |")
    print("|---|---|---|---|---|")
    for name, r in result["schemes"].items():
        print(f"| {name} | {r['seconds']:.3f} | {r['s_per_gb']:.2f} | "
              f"{r['s_per_gb_per_engine']:.2f} | {r['vs_object_store']:.2f} |")
    if "first_broadcast_s" in result:
        print(f"\nfirst broadcast push (makes the sync group, first calls): "
              f"{result['first_broadcast_s']:.3f} s; a warm push that makes a new group: "
              f"{result['new_group_broadcast_s']:.3f} s")


def main(argv: list[str] | None = None) -> dict:
    parser = bench_parser(__doc__)
    parser.add_argument("--mb", type=float, default=256.0)
    parser.add_argument("--engines", type=int, default=2)
    parser.add_argument("--bucket-mb", type=float, default=64.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cuda: NCCL broadcast, one GPU per peer")
    parser.add_argument("--through", choices=("peers", "pool"), default="peers",
                        help="pool: the job's push through a CellPool's learner and runners")
    args = parser.parse_args(argv)
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2 if args.device == "cpu" else None,
                 num_gpus=args.engines + 1 if args.through == "pool" else None,
                 object_store_memory=800 * 1024 ** 2, include_dashboard=False)
    try:
        if args.through == "pool":
            if args.device != "cpu":
                parser.error("--through pool runs on CPU (gloo) only")
            result = bench_pool(seed=args.seed, mb=args.mb, engines=args.engines,
                                repeats=1 if args.smoke else args.repeats,
                                bucket_mb=1.0 if args.smoke else args.bucket_mb,
                                smoke=args.smoke)
        else:
            result = bench(seed=args.seed, mb=4.0 if args.smoke else args.mb,
                           engines=args.engines, repeats=1 if args.smoke else args.repeats,
                           bucket_mb=1.0 if args.smoke else args.bucket_mb, device=args.device)
    finally:
        if started:
            ray.shutdown()
    return finish(result, show=print_table, json_path=args.json)


if __name__ == "__main__":
    main()
