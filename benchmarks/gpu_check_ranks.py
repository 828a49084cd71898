"""``gpu_check --torch-only``'s two-rank stage: two processes (NCCL on CUDA, gloo on CPU), no
Ray, each a ``LearnerRank`` of one 2-rank cell, then the weight-sync paths between them.

```
parent: TCPStore (the driver's, for the sync group) ── spawn rank 0, rank 1
rank r: LearnerRank(rank r of 2).setup            FSDP2 over the 2-rank world group
        accumulate(micro-batch) → take_gradients  rank 0: vs plain torch on the whole batch
        get_weights → send / receive (world group) rank 1 reads every bucket on ANOTHER thread
                                                   and stream: sums equal rank 0's
        SyncGroups (the driver's store): version 1 delivered; version 2: rank 0 publishes the
        plan and never sends (a lost peer) → rank 1 raises within SyncSpec.timeout_s, aborts
        the group, and (CUDA) is still alive after NCCL's own timeout would have passed
```

One GPU: NCCL refuses two ranks on one device ("Duplicate GPU detected", NCCL init.cc), so
each rank gets its own ``NCCL_HOSTID`` and NCCL treats them as two hosts (network transport
over loopback). Two GPUs or more: a GPU per rank.
"""

from __future__ import annotations

import datetime
import os
import pickle
import queue as queue_mod
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

SYNC_TIMEOUT_S = 3.0
"""``SyncSpec.timeout_s`` of the lost-peer check."""


def _pin(rank: int, device: str) -> dict:
    """This rank's device environment (before CUDA initialises); returns what was set."""
    if device != "cuda":
        return {}
    count = torch.cuda.device_count()       # NVML-based: does not initialise CUDA
    env = {"CUDA_VISIBLE_DEVICES": str(rank % count) if count > 1 else "0"}
    if count < 2:
        env.update(NCCL_HOSTID=f"gpu_check_rank{rank}", NCCL_SOCKET_IFNAME="lo")
    os.environ.update(env)
    return env


def _step(rank: int, cfg: dict) -> tuple[Any, dict]:
    """The FSDP2 step; rank 0 compares the cell's gradient with plain torch's."""
    from gpu_check_torch import learner_rank, micro

    from ray_xlong.models import load_model
    from ray_xlong.trajectory import LossConfig, policy_loss
    from ray_xlong.trajectory.model import token_logprobs
    from ray_xlong.trajectory.packing import PackedBatch
    from ray_xlong.trajectory.tree_attention import register

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    lr = learner_rank(cfg["device"], cfg["model_dir"], rank=rank, world=2, port=cfg["port"],
                      mixed_precision=None)
    batch = micro(cfg["seed"])
    t0 = time.perf_counter()
    lr.accumulate(batch)
    grads = lr.take_gradients()
    out = {"fsdp_step_s": time.perf_counter() - t0}
    if rank == 0:
        register()
        model = load_model(cfg["model_dir"], attn_implementation="xlong_tree").to(lr.device)
        whole = PackedBatch.from_tensors({k: v if k in ("run_ids", "layout") else
                                          v.to(lr.device) for k, v in batch.items()})
        loss, _ = policy_loss(token_logprobs(model, whole), whole, LossConfig())
        loss.backward()
        ref = {n: p.grad.cpu() for n, p in model.named_parameters()}
        out["grad_rel_diff"] = max(float((grads[n] - ref[n]).norm() / ref[n].norm()
                                         .clamp_min(1e-30)) for n in ref)
    return lr, out


def _consume(part: dict, stream: Any) -> float:
    """Another thread reads a received bucket on its own stream (the engine's batch thread
    does this with the loaded weights)."""
    ctx = torch.cuda.stream(stream) if stream is not None else _null()
    with ctx:
        host = torch.cat([t.reshape(-1).to("cpu", torch.float64) for t in part.values()])
    return float(host.sum())


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


def _stream_order(rank: int, lr: Any, cfg: dict) -> dict:
    """Full weights from rank 0 over the world group; rank 1 reads each bucket on another
    thread and stream as soon as ``receive`` yields it."""
    import torch.distributed as dist

    from ray_xlong.cells.weight_sync import bucket_plan, receive, send

    weights = lr.get_weights()                            # collective; rank 0 holds them
    dev = "cuda" if cfg["device"] == "cuda" else "cpu"
    box: list[Any] = [None, None]
    if rank == 0:
        plan = bucket_plan(weights, bucket_mb=0.05)
        box = [plan, [float(torch.cat([weights[n].reshape(-1).to(torch.float64)
                                       for n in b.names]).sum()) for b in plan]]
    dist.broadcast_object_list(box, src=0)
    plan, sums = box
    if rank == 0:
        send(weights, plan, device=dev, timeout_s=60.0)
        return {"buckets": len(plan)}
    stream = torch.cuda.Stream() if dev == "cuda" else None
    with ThreadPoolExecutor(1) as reader:             # not the thread that received
        got = [reader.submit(_consume, part, stream).result()
               for part in receive(plan, device=dev, timeout_s=60.0)]
    return {"stream_sync_ok": got == sums}


def _lost_peer(rank: int, cfg: dict, keep: list) -> dict:
    """A sync group whose sender publishes version 2's plan and never sends it (alive and
    silent: its group stays open in ``keep`` until the receiver is done, so only the
    receiver's deadline can end the wait)."""
    from ray_xlong.cells.weight_sync import (NCCL_TIMEOUT_FACTOR, SyncGroups, SyncSpec,
                                             bucket_plan)

    backend = "nccl" if cfg["device"] == "cuda" else "gloo"
    spec = SyncSpec("0/s0/t1", "127.0.0.1", cfg["store_port"], rank, 2, backend,
                    timeout_s=SYNC_TIMEOUT_S, bucket_mb=1.0)
    state = {"w": torch.arange(1000, dtype=torch.float32), "b": torch.ones(10)}
    groups = SyncGroups()
    keep.append(groups)
    if rank == 0:
        groups.send(spec, state, 1)
        _, store = groups.group(spec)
        store.set("plan/2", pickle.dumps(bucket_plan(state, bucket_mb=1.0)))
        return {}
    got = groups.receive(spec, 1)
    out = {"sync_v1_ok": all(torch.equal(got[k], state[k]) for k in state)}
    t0 = time.perf_counter()
    try:
        groups.receive(spec, 2)
        out["lost_peer_error"] = None
    except Exception as exc:  # noqa: BLE001 - what the fallback sees
        out["lost_peer_error"] = f"{type(exc).__name__}: {exc}"[:160]
    out.update(lost_peer_s=time.perf_counter() - t0, groups_aborted=groups.aborted)
    if cfg["device"] == "cuda":     # outlive NCCL's own timeout of the aborted group
        time.sleep(NCCL_TIMEOUT_FACTOR * SYNC_TIMEOUT_S + 3.0)
        torch.ones(1, device="cuda").add_(1).item()
    out["survived"] = True
    return out


def _rank_main(rank: int, cfg: dict, results: Any) -> None:
    """One rank: the three checks in order; its findings (or its error) go to ``results``."""
    import torch.distributed as dist

    out: dict[str, Any] = {"env": _pin(rank, cfg["device"])}
    keep: list = []
    try:
        lr, step = _step(rank, cfg)
        out.update(step)
        out.update(_stream_order(rank, lr, cfg))
        out.update(_lost_peer(rank, cfg, keep))
        dist.barrier()
        for groups in keep:
            groups.drop("0/s0/t1")
        dist.destroy_process_group()
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        out["error"] = f"rank {rank}: {type(exc).__name__}: {exc}"[:400]
        out["traceback"] = traceback.format_exc()[-1500:]
    results.put((rank, out))


def stage_two_ranks(device: str, seed: int, root: str) -> dict:
    """Spawn the two ranks (module docstring) and merge what they found."""
    import socket

    import torch.distributed as dist
    import torch.multiprocessing as mp

    from gpu_check_torch import TINY, model_dir

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    store = dist.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=120),
                          wait_for_workers=False)
    cfg = {"device": device, "seed": seed, "port": port, "store_port": store.port,
           "model_dir": model_dir(root, "tiny", seed, config=TINY)}
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(r, cfg, results)) for r in range(2)]
    for p in procs:
        p.start()
    found: dict[int, dict] = {}
    try:
        while len(found) < 2:
            rank, out = results.get(timeout=300)
            found[rank] = out
    except queue_mod.Empty:
        pass
    for p in procs:
        p.join(timeout=30)
        if p.is_alive():
            p.kill()
    errors = [o["error"] for o in found.values() if "error" in o]
    if len(found) < 2 or errors:
        for o in found.values():
            print(o.get("traceback", ""))
        raise RuntimeError(f"two_ranks: {errors or 'a rank never reported'}")
    merged = {**found[0], **found[1], "backend": "nccl" if device == "cuda" else "gloo",
              "nccl_hostid_per_rank": "NCCL_HOSTID" in found[1]["env"]}
    merged.pop("env")
    if merged["grad_rel_diff"] > 1e-3 or not merged["stream_sync_ok"] \
            or not merged["sync_v1_ok"] or merged["lost_peer_error"] is None:
        raise AssertionError(f"two_ranks: {merged}")
    return merged
