"""Learner → engines weight sync in buckets over a process group, never through the driver.

```
sender (training cell rank 0)              receivers (each rollout cell's runner)
plan = bucket_plan(names, shapes, dtypes)  same plan (from the same model: shapes agree)
for bucket in plan:                        for bucket in plan:
  flat = cat(tensors of bucket)  ──bcast──►  flat = empty(bucket bytes); unflatten → names
                                             engine.update_weights(part)   (or collect all)
```

One collective per bucket (``bucket_mb`` caps its size, so the staging memory on both sides is
a bucket, not the model). On CPU the group is gloo (tested here); on GPU it is NCCL between
the Learner's GPU and the engines' GPUs, and vLLM loads the received buckets through its
``load_weights`` between batches (``VLLMEngine.update_weights``) — that path is written, not run
on a GPU here. Where Learner and engine share a device (colocated), CUDA IPC handles
(``torch.multiprocessing.reductions.reduce_tensor``) replace the copy; not written yet.

Inside a job (``CellJobConfig.weight_sync='broadcast'``, ``cells/broadcast.py`` drives it) the
group is a :class:`SyncSpec`: the sender (a Learner that applied the step) and the runners of the
target cells, made on first need and cached by each member under the spec's key
(:class:`SyncGroups`), apart from any default process group (a sharded cell's rank 0 already
has its cell's FSDP group): a ``ProcessGroupGloo`` / ``ProcessGroupNCCL`` on a ``TCPStore`` the
driver hosts (rendezvous only: no tensor goes through it). The sender puts the bucket plan in
that store, so the receivers need no model of their own to agree on it. Every collective is
bounded by ``SyncSpec.timeout_s``: a member lost mid-sync fails the others' calls, never hangs
them.
"""

from __future__ import annotations

import dataclasses
import datetime
import pickle
from typing import Any, Iterator, Mapping

import torch
import torch.distributed as dist


@dataclasses.dataclass(frozen=True, slots=True)
class Bucket:
    """Tensors sent as one flat buffer."""

    names: tuple[str, ...]
    """Parameter names, in order."""
    shapes: tuple[tuple[int, ...], ...]
    """Their shapes."""
    dtype: torch.dtype
    """Their dtype (a bucket holds one dtype)."""

    @property
    def numel(self) -> int:
        """Elements in the flat buffer."""
        return sum(int(torch.Size(s).numel()) for s in self.shapes)


def bucket_plan(state_dict: Mapping[str, torch.Tensor], *, bucket_mb: float = 256.0
                ) -> list[Bucket]:
    """Group ``state_dict``'s tensors, in order, into same-dtype buckets of ≤ ``bucket_mb`` MB
    (a tensor larger than that goes alone). Deterministic: sender and receivers agree."""
    if not bucket_mb > 0:
        raise ValueError(f"bucket_plan.bucket_mb must be > 0, got {bucket_mb!r}")
    limit = bucket_mb * 1e6
    out: list[Bucket] = []
    names: list[str] = []
    size, dtype = 0, None
    for name, t in state_dict.items():
        nbytes = t.numel() * t.element_size()
        if names and (t.dtype != dtype or size + nbytes > limit):
            out.append(_bucket(names, state_dict))
            names, size = [], 0
        names.append(name)
        size, dtype = size + nbytes, t.dtype
    if names:
        out.append(_bucket(names, state_dict))
    return out


def _bucket(names: list[str], state_dict: Mapping[str, torch.Tensor]) -> Bucket:
    return Bucket(tuple(names), tuple(tuple(state_dict[n].shape) for n in names),
                  state_dict[names[0]].dtype)


def send(state_dict: Mapping[str, torch.Tensor], plan: list[Bucket], *, src: int = 0,
         group: dist.ProcessGroup | None = None, device: str = "cpu") -> int:
    """Broadcast ``state_dict`` bucket by bucket from rank ``src``. Returns bytes sent."""
    sent = 0
    for bucket in plan:
        flat = torch.cat([state_dict[n].detach().reshape(-1).to(device, bucket.dtype)
                          for n in bucket.names])
        _broadcast(flat, src, group)
        sent += flat.numel() * flat.element_size()
    return sent


def receive(plan: list[Bucket], *, src: int = 0, group: dist.ProcessGroup | None = None,
            device: str = "cpu") -> Iterator[dict[str, torch.Tensor]]:
    """Receive :func:`send`'s buckets; yields each as ``{name: tensor}`` (load it, or collect
    ``dict(ChainMap)`` of all for a full state dict)."""
    for bucket in plan:
        flat = torch.empty(bucket.numel, dtype=bucket.dtype, device=device)
        _broadcast(flat, src, group)
        parts, start = {}, 0
        for name, shape in zip(bucket.names, bucket.shapes):
            n = int(torch.Size(shape).numel())
            parts[name] = flat[start:start + n].view(shape)
            start += n
        yield parts


def _broadcast(flat: torch.Tensor, src: int, group: Any) -> None:
    """``dist.broadcast`` on the default or a registered group; on a group made outside
    ``torch.distributed``'s registry (:class:`SyncGroups`) the group's own call."""
    if group is None or group in dist.distributed_c10d._world.pg_map:
        dist.broadcast(flat, src=src, group=group)
        return
    opts = dist.BroadcastOptions()
    opts.rootRank, opts.rootTensor = src, 0
    group.broadcast([flat], opts).wait()


@dataclasses.dataclass(frozen=True, slots=True)
class SyncSpec:
    """One member's view of a sync group (sender rank 0, receivers 1 …)."""

    key: str
    """Names the group (generation, sender, targets): members cache their group under it."""
    host: str
    """Address of the driver's ``TCPStore`` (rendezvous and the bucket plan only)."""
    port: int
    """Its port."""
    rank: int
    """This member's rank (0: the sender)."""
    world: int
    """1 + receivers."""
    backend: str = "gloo"
    """``gloo`` (CPU tensors) or ``nccl`` (CUDA tensors)."""
    timeout_s: float = 60.0
    """Bound of every rendezvous and collective of the group."""
    bucket_mb: float = 256.0
    """Bucket size cap (the sender's plan)."""

    @property
    def generation(self) -> int:
        """The key's leading generation (a bump drops every older group)."""
        return int(self.key.split("/", 1)[0])

    @property
    def device(self) -> str:
        """Where the buckets live on both sides."""
        return "cuda" if self.backend == "nccl" else "cpu"


class SyncGroups:
    """A member's sync groups by key (made on first use; a newer generation drops the older
    ones, whose peers may be dead)."""

    def __init__(self) -> None:
        self.groups: dict[str, tuple[Any, Any]] = {}

    def group(self, spec: SyncSpec) -> tuple[Any, Any]:
        """``(process group, its prefix store)`` of ``spec`` (collective on first use: every
        member of the spec must call it)."""
        for key in [k for k in self.groups if int(k.split("/", 1)[0]) < spec.generation]:
            self.drop(key)
        if spec.key not in self.groups:
            timeout = datetime.timedelta(seconds=spec.timeout_s)
            store = dist.PrefixStore(spec.key, dist.TCPStore(
                spec.host, spec.port, None, False, timeout))
            if spec.backend == "nccl":
                opts = dist.ProcessGroupNCCL.Options()
                opts._timeout = timeout
                pg = dist.ProcessGroupNCCL(store, spec.rank, spec.world, opts)
            else:
                pg = dist.ProcessGroupGloo(store, spec.rank, spec.world, timeout)
            self.groups[spec.key] = (pg, store)
        return self.groups[spec.key]

    def drop(self, key: str) -> None:
        """Forget group ``key`` (after a failure its peers may be gone)."""
        pg, _ = self.groups.pop(key, (None, None))
        if pg is not None and hasattr(pg, "shutdown"):
            try:
                pg.shutdown()
            except Exception:  # noqa: BLE001 - a broken group may refuse; it is dropped anyway
                pass

    def send(self, spec: SyncSpec, state_dict: Mapping[str, torch.Tensor], version: int
             ) -> int:
        """Rank 0: the plan of ``state_dict`` into the store, then its buckets. Bytes sent."""
        pg, store = self.group(spec)
        plan = bucket_plan(state_dict, bucket_mb=spec.bucket_mb)
        store.set(f"plan/{version}", pickle.dumps(plan))
        try:
            return send(state_dict, plan, group=pg, device=spec.device)
        except Exception:
            self.drop(spec.key)
            raise

    def receive(self, spec: SyncSpec, version: int) -> dict[str, torch.Tensor]:
        """Rank ≥ 1: the sender's state dict of ``version``, whole (each bucket's views into
        its flat buffer)."""
        pg, store = self.group(spec)
        try:
            plan = pickle.loads(store.get(f"plan/{version}"))
            out: dict[str, torch.Tensor] = {}
            for part in receive(plan, group=pg, device=spec.device):
                out.update(part)
            return out
        except Exception:
            self.drop(spec.key)
            raise
