"""Bucketed weight sync over a gloo group (2 processes): the receiver rebuilds the sender's
state dict exactly; the plan caps a bucket's size and splits on dtype. With fake groups (the
CUDA paths forced on CPU): a bucket is read only after its stream sync, a collective that never
completes aborts its group within the deadline, an NCCL sync group is built to keep its
process alive."""

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


class FakeWork:
    """A collective's work: completes after ``polls`` ``is_completed`` calls (never: None)."""

    def __init__(self, log: list, polls: int | None) -> None:
        self.log, self.polls = log, polls

    def is_completed(self) -> bool:
        if self.polls is None:
            return False
        self.polls -= 1
        return self.polls < 0

    def wait(self) -> bool:
        self.log.append("wait")
        return True


class FakeGroup:
    """A process group outside torch's registry: ``broadcast`` records the receive buffer,
    which the (fake) stream sync fills, as a device stream makes NCCL's write visible only
    once synchronised."""

    def __init__(self, log: list, polls: int | None = 2) -> None:
        self.log, self.polls, self.buffers, self.aborts = log, polls, [], 0

    def broadcast(self, tensors, opts):
        self.log.append("broadcast")
        self.buffers.append(tensors[0])
        return FakeWork(self.log, self.polls)

    def abort(self) -> None:
        self.aborts += 1


class FakeStore:
    def __init__(self, plan) -> None:
        import pickle

        self.value = pickle.dumps(plan)

    def get(self, key: str) -> bytes:
        return self.value


def _spec(timeout_s: float = 5.0):
    from ray_xlong.cells.weight_sync import SyncSpec

    return SyncSpec("0/s0/t1", "127.0.0.1", 1, 1, 2, timeout_s=timeout_s, bucket_mb=0.003)


def test_a_bucket_is_read_only_after_its_stream_sync(monkeypatch):
    """CUDA's path forced on CPU: the stream sync (faked on 'cpu') is what makes the bucket's
    values land; the receiver's state dict equals the sender's only if every bucket was
    synchronised before it was read, and the log shows poll → wait → sync per bucket."""
    from ray_xlong.cells import weight_sync
    from ray_xlong.cells.weight_sync import SyncGroups

    sd, log = state(), []
    plan = bucket_plan(sd, bucket_mb=0.003)
    flat = {i: torch.cat([sd[n].reshape(-1).to(b.dtype) for n in b.names])
            for i, b in enumerate(plan)}
    pg = FakeGroup(log)

    def stream_sync(device):
        log.append("sync")
        i = len(pg.buffers) - 1
        pg.buffers[i].copy_(flat[i])

    monkeypatch.setitem(weight_sync.STREAM_SYNC, "cpu", stream_sync)
    groups = SyncGroups()
    groups.groups["0/s0/t1"] = (pg, FakeStore(plan))
    got = groups.receive(_spec(), 7)
    assert list(got) == list(sd) and all(torch.equal(got[k], sd[k]) for k in sd)
    assert log == ["broadcast", "wait", "sync"] * len(plan)


def test_a_collective_that_never_completes_aborts_its_group_within_the_deadline():
    """A peer lost mid-sync (its broadcast never completes, as NCCL's would hang): the
    receiver raises SyncTimeout after SyncSpec.timeout_s, aborts the group (NCCL: before the
    watchdog's own timeout would kill the process) and forgets it."""
    import time

    from ray_xlong.cells.weight_sync import SyncGroups, SyncTimeout

    pg = FakeGroup([], polls=None)
    groups = SyncGroups()
    groups.groups["0/s0/t1"] = (pg, FakeStore(bucket_plan(state(), bucket_mb=0.003)))
    t0 = time.monotonic()
    with pytest.raises(SyncTimeout, match="SyncSpec.timeout_s"):
        groups.receive(_spec(timeout_s=0.2), 7)
    assert time.monotonic() - t0 < 5.0
    assert pg.aborts == 1 and groups.aborted == 1 and not groups.groups


def test_an_nccl_sync_group_keeps_its_process_and_outlives_the_deadline(monkeypatch):
    """The NCCL group is built (ProcessGroupNCCL faked: this torch has no NCCL) with
    TORCH_NCCL_ASYNC_ERROR_HANDLING=2 set during construction only and an NCCL timeout of
    NCCL_TIMEOUT_FACTOR × SyncSpec.timeout_s."""
    import dataclasses
    import datetime
    import os
    import types

    import torch.distributed as dist

    from ray_xlong.cells import weight_sync

    seen = {}

    class FakeNCCL:
        Options = types.SimpleNamespace

        def __init__(self, store, rank, world, opts) -> None:
            seen.update(env=os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING"),
                        timeout=opts._timeout, rank=rank, world=world)

    monkeypatch.setattr(dist, "ProcessGroupNCCL", FakeNCCL, raising=False)
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")        # what Ray's setup sets
    server = dist.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=5),
                           wait_for_workers=False)
    spec = dataclasses.replace(_spec(timeout_s=30.0), port=server.port, backend="nccl")
    weight_sync._make_group(spec)
    assert seen == {"env": "2", "timeout": datetime.timedelta(seconds=120), "rank": 1,
                    "world": 2}
    assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"


def test_sync_groups_helper_makes_one_per_owner():
    from ray_xlong.cells.weight_sync import SyncGroups, sync_groups

    class Owner:
        pass

    a, b = Owner(), Owner()
    assert isinstance(sync_groups(a), SyncGroups)
    assert sync_groups(a) is sync_groups(a) and sync_groups(a) is not sync_groups(b)


def test_a_group_whose_member_never_connects_is_given_up_within_its_timeout():
    """gloo's own connect can wait far past the group's timeout on a member that published its
    address and died; the creation is bounded (the actor, and every call queued behind it, is
    free again), and a group that connects late is aborted where it was made."""
    import threading
    import time

    from ray_xlong.cells.weight_sync import SyncSpec, SyncTimeout, _bounded

    spec = SyncSpec("1/0/1", "127.0.0.1", 0, 0, 2, timeout_s=0.2)
    release, aborted = threading.Event(), threading.Event()

    class LateGroup:
        def abort(self):
            aborted.set()

    def connect_late():
        release.wait(10)
        return LateGroup()

    t = time.monotonic()
    with pytest.raises(SyncTimeout, match=r"rank 0 of 2 not connected after 0.3 s"):
        _bounded(connect_late, spec, margin_s=0.1)
    assert time.monotonic() - t < 5
    release.set()
    assert aborted.wait(5), "the group that connected late was not aborted"
    assert _bounded(lambda: "group", spec) == "group"
    with pytest.raises(ValueError, match="refused"):
        _bounded(lambda: (_ for _ in ()).throw(ValueError("refused")), spec)
