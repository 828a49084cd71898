"""Bucketed weight sync over a gloo group (2 processes): the receiver rebuilds the sender's
state dict exactly; the plan caps a bucket's size and splits on dtype."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.multiprocessing as mp

from ray_xlong.cells.weight_sync import bucket_plan, receive, send


def state() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {"embed": torch.randn(64, 8, generator=gen), "norm": torch.ones(8),
            "step": torch.arange(3, dtype=torch.int64), "head": torch.randn(8, 64, generator=gen)}


def test_plan_caps_buckets_and_splits_on_dtype():
    plan = bucket_plan(state(), bucket_mb=0.003)       # 3000 B: embed (2048 B) + norm (32 B)
    assert [b.names for b in plan] == [("embed", "norm"), ("step",), ("head",)]
    assert plan[1].dtype == torch.int64 and plan[0].numel == 64 * 8 + 8
    with pytest.raises(ValueError, match="bucket_plan.bucket_mb"):
        bucket_plan(state(), bucket_mb=0)


def _peer(rank: int, port: int, out) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    sd = state()
    plan = bucket_plan(sd, bucket_mb=0.003)
    if rank == 0:
        send(sd, plan)
    else:
        got = {}
        for part in receive(plan):
            got.update({k: v.clone() for k, v in part.items()})
        out.put(all(torch.equal(got[k], sd[k]) for k in sd) and list(got) == list(sd))
    dist.destroy_process_group()


def test_receiver_gets_the_senders_state_dict_exactly():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_peer, args=(r, port, out)) for r in range(2)]
    for p in procs:
        p.start()
    ok = out.get(timeout=120)
    for p in procs:
        p.join(timeout=60)
    assert ok is True


def _sync_members(world: int, *, absent: int | None = None, timeout_s: float = 20.0):
    """Run a SyncGroups sender (rank 0) and receivers as threads on a driver-side TCPStore;
    returns ``{rank: state dict received | bytes sent | the exception raised}``."""
    import datetime
    import threading

    import torch.distributed as dist

    from ray_xlong.cells.weight_sync import SyncGroups, SyncSpec

    store = dist.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=timeout_s),
                          wait_for_workers=False)
    spec = SyncSpec("0/s0/t1.2", "127.0.0.1", store.port, 0, world, timeout_s=timeout_s,
                    bucket_mb=0.003)
    out, groups = {}, {r: SyncGroups() for r in range(world)}

    def member(rank: int) -> None:
        import dataclasses

        try:
            mine = dataclasses.replace(spec, rank=rank)
            out[rank] = (groups[rank].send(mine, state(), 7) if rank == 0
                         else {k: v.clone() for k, v in groups[rank].receive(mine, 7).items()})
        except Exception as exc:  # noqa: BLE001 - the test reads it
            out[rank] = exc

    threads = [threading.Thread(target=member, args=(r,)) for r in range(world) if r != absent]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=4 * timeout_s)
    assert not any(t.is_alive() for t in threads), "a member hung past its timeout"
    return out, groups


def test_sync_groups_deliver_the_senders_state_to_every_receiver():
    out, groups = _sync_members(3)
    sd = state()
    assert out[0] == sum(t.numel() * t.element_size() for t in sd.values())
    for r in (1, 2):
        assert list(out[r]) == list(sd) and all(torch.equal(out[r][k], sd[k]) for k in sd)
    assert all("0/s0/t1.2" in g.groups for g in groups.values())   # cached for the next push


def test_sync_groups_fail_within_the_timeout_when_a_member_is_gone():
    out, groups = _sync_members(3, absent=2, timeout_s=3.0)
    assert isinstance(out[0], Exception) and isinstance(out[1], Exception)
    assert not any(g.groups for g in groups.values())     # nothing half-made is kept
