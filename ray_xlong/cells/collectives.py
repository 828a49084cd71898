"""Collectives between the cells of a step: the gradient reduction, and the state a cell that
enters training loads from a live holder — rank to rank, never through the driver.

```
driver (ElasticLearnerGroup)                    Learners (XLongLearner; LearnerRank i of a cell)
PeerGroups: TCPStore (rendezvous only),         PeerGroup.spec(rank i, device) → SyncSpec with
  one key per (kind, cell set), LRU of `limit`,   key "<key>/s<i>" (weight_sync.SyncSpec)
  a set whose collective failed gets a new key  sync_groups(owner, "collectives", limit): the
                                                  group made on first use (gloo | NCCL by the
                                                  device), LRU-cached, aborted when it fails
finish  ─► reduce_step(group_c, total, v) ──►   rank i of every member: all-reduce (SUM) of its
           on every member                        own gradient shard, bucket by bucket, each
                                                  landed by the group's timeout; only then
                                                  p.grad ← Σ / total and one Adam step
join    ─► send_state(StateFrom) on a holder ║  rank i of the holder broadcasts its parameter and
           wake_up(StateFrom) on the joiner  ║  optimizer shards to rank i of the joiner
```

Rank *i* of a sharded cell meets rank *i* of the other cells (same ``ranks_per_cell``, so the
same FSDP shard layout): no full gradient or state is gathered anywhere. A failed or timed-out
collective leaves every member's own gradient untouched (the sums land in separate buffers),
so the caller can fall back to the object-store reduction (``cells/reduce.py``).

:data:`traffic` counts, per process, the bytes this module and the Learner's state calls move
(``benchmarks/state_bytes.py`` reads it): an all-reduce of ``B`` bytes over ``n`` members counts
``2(n−1)/n · B`` in and out (the ring's), a broadcast ``B`` out of the holder and into the
joiner, an object-store value its pickled tensors.
"""

from __future__ import annotations

import collections
import dataclasses
import datetime
import secrets
from typing import Any, Mapping

import torch
import torch.distributed as dist

from ray_xlong.cells.weight_sync import SyncSpec, bucket_plan, land, sync_groups

COLLECTIVES = "collectives"
"""``sync_groups`` name of the groups between cells (apart from the weight syncs')."""
GROUP_LIMIT = 8
"""Groups a Learner (and the driver's key cache) keeps; the driver's least recently used key
is the first a member evicts, so both sides agree on which groups live."""

traffic: collections.Counter[str] = collections.Counter()
"""Bytes this process moved, by ``"<what>_<in|out>"`` (module docstring)."""


def count(what: str, direction: str, tensors: Any) -> int:
    """Add the bytes of ``tensors`` (a tensor, a mapping or sequence of them, nested) to
    :data:`traffic` under ``what_direction``; returns them."""
    n = nbytes(tensors)
    traffic[f"{what}_{direction}"] += n
    return n


def gathered(module: torch.nn.Module, what: str) -> int:
    """Count an all-gather of ``module``'s sharded parameters (or their gradients) to every
    rank: each receives and sends the bytes of the shards it lacks. Returns them."""
    n = sum((p.numel() - local(p).numel()) * p.element_size() for p in module.parameters())
    traffic[f"{what}_in"] += n
    traffic[f"{what}_out"] += n
    return n


def nbytes(value: Any) -> int:
    """Bytes of the tensors in ``value`` (nested mappings / sequences; others count 0)."""
    if torch.is_tensor(value):
        return local(value).numel() * value.element_size()
    if isinstance(value, Mapping):
        return sum(nbytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(nbytes(v) for v in value)
    return 0


@dataclasses.dataclass(frozen=True, slots=True)
class PeerGroup:
    """One cell's view of a group between cells (every rank of the cell uses it)."""

    key: str
    """``"0/<kind>/<nonce>/<cells>"``; rank *i* of the cell adds ``"/s<i>"``."""
    host: str
    """Address of the driver's ``TCPStore`` (rendezvous only)."""
    port: int
    """Its port."""
    position: int
    """This cell's rank in the group."""
    size: int
    """Cells in the group."""
    timeout_s: float = 60.0
    """Bound of the rendezvous and of every collective."""
    bucket_mb: float = 256.0
    """Flat buffers of at most this size (one collective each)."""

    def spec(self, rank: int, device: torch.device) -> SyncSpec:
        """The ``SyncSpec`` of the cell's rank ``rank`` (NCCL for CUDA tensors, else gloo)."""
        backend = "nccl" if device.type == "cuda" else "gloo"
        return SyncSpec(f"{self.key}/s{rank}", self.host, self.port, self.position, self.size,
                        backend, self.timeout_s, self.bucket_mb)


@dataclasses.dataclass(frozen=True, slots=True)
class StateFrom:
    """``wake_up(state=...)`` / ``send_state``: the state of ``version`` goes from the group's
    position 0 (a holder) to position 1 (the joiner)."""

    group: PeerGroup
    """The pair's group (this side's position)."""
    version: int
    """The version sent."""


class PeerGroups:
    """The driver's side: the rendezvous store and the key of each cell set (module docstring).
    Holds no tensor and joins no group."""

    def __init__(self, *, timeout_s: float = 60.0, bucket_mb: float = 256.0,
                 limit: int = GROUP_LIMIT, host: str | None = None) -> None:
        if host is None:
            from ray.util import get_node_ip_address

            host = get_node_ip_address()
        self.host, self.timeout_s, self.bucket_mb, self.limit = host, timeout_s, bucket_mb, limit
        self.store = dist.TCPStore(host, 0, None, True, datetime.timedelta(seconds=timeout_s),
                                   wait_for_workers=False)
        self.port = self.store.port
        self.epoch = f"{self.port}-{secrets.token_hex(3)}"
        """Names this store's groups apart from any earlier store's: members keep their groups
        past a driver (a new actuator on the same cells, as the mode benchmarks run one after
        another), and a key issued again would find a group on a closed store."""
        self.keys: collections.OrderedDict[tuple[str, tuple[int, ...]], str] = \
            collections.OrderedDict()
        self.made = 0
        """Keys issued (a new one per new set, evicted set or failure)."""
        self.failures = 0
        """Collectives reported failed (:meth:`failed`)."""

    def groups(self, kind: str, cells: tuple[int, ...]) -> dict[int, PeerGroup]:
        """Each cell's :class:`PeerGroup` for the ordered ``cells`` (position = index)."""
        name = (kind, tuple(cells))
        if name in self.keys:
            self.keys.move_to_end(name)
        else:
            self.made += 1
            self.keys[name] = f"0/{kind}/{self.epoch}.{self.made}/{'.'.join(map(str, cells))}"
            while len(self.keys) > self.limit:
                self.keys.popitem(last=False)
        key = self.keys[name]
        return {c: PeerGroup(key, self.host, self.port, i, len(cells), self.timeout_s,
                             self.bucket_mb) for i, c in enumerate(cells)}

    def failed(self, kind: str, cells: tuple[int, ...]) -> None:
        """A collective of that set failed: its next use makes a new group."""
        self.failures += 1
        self.keys.pop((kind, tuple(cells)), None)


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t`` (a DTensor's local shard; any other tensor itself)."""
    to_local = getattr(t, "to_local", None)
    return to_local() if to_local is not None else t


def _allreduce(flat: torch.Tensor, pg: Any) -> Any:
    """Start a SUM all-reduce of ``flat`` on ``pg`` (a group outside torch's registry)."""
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.SUM
    return pg.allreduce([flat], opts)


def reduce_gradients(module: torch.nn.Module, owner: Any, spec: SyncSpec | None,
                     total: float) -> int:
    """Set every parameter's gradient to ``Σ over the group of its local gradient / total``
    (zeros where a member has none). The sums land in separate buffers; only when every
    bucket landed are the gradients replaced, so a failure leaves them as they were.

    Args:
        module: the Learner's model (plain or FSDP2-sharded: each rank reduces its shards).
        owner: the actor holding the groups (``sync_groups(owner, COLLECTIVES)``).
        spec: this rank's view of the step's group (None: the step's only member).
        total: the step's normalizer (> 0).

    Returns:
        Bytes reduced (one copy of this rank's gradient).

    Raises:
        Exception: the group could not be made or a collective failed or timed out (the
            group is aborted and forgotten).
    """
    params = dict(module.named_parameters())
    grads = {n: (local(p.grad) if p.grad is not None else torch.zeros_like(local(p.detach())))
             for n, p in params.items()}
    if spec is None:
        summed = dict(grads)
    else:
        summed = _all_reduce(grads, owner, spec)
    moved = 0
    with torch.no_grad():
        for name, p in params.items():
            if p.grad is None:
                p.grad = torch.zeros_like(p.detach())
            local(p.grad).copy_(summed[name] / total)
            moved += summed[name].numel() * summed[name].element_size()
    if spec is not None:
        ring = 2 * (spec.world - 1) / spec.world * moved
        traffic["reduce_in"] += int(ring)
        traffic["reduce_out"] += int(ring)
    return moved


def _all_reduce(grads: dict[str, torch.Tensor], owner: Any, spec: SyncSpec
                ) -> dict[str, torch.Tensor]:
    """``grads`` summed over ``spec``'s group, bucket by bucket, into new buffers."""
    groups = sync_groups(owner, COLLECTIVES, limit=GROUP_LIMIT)
    plan = bucket_plan(grads, bucket_mb=spec.bucket_mb)
    summed: dict[str, torch.Tensor] = {}
    try:
        pg, _ = groups.group(spec)
        for bucket in plan:
            flat = torch.cat([grads[n].detach().reshape(-1).to(bucket.dtype)
                              for n in bucket.names])
            land(_allreduce(flat, pg), flat, timeout_s=spec.timeout_s)
            start = 0
            for name, shape in zip(bucket.names, bucket.shapes):
                size = int(torch.Size(shape).numel())
                summed[name] = flat[start:start + size].view(shape)
                start += size
    except Exception:
        groups._abort(spec.key)
        raise
    return summed


def state_tensors(module: torch.nn.Module, optimizer: torch.optim.Optimizer
                  ) -> dict[str, torch.Tensor]:
    """This rank's parameters (``p/<name>``) and optimizer state tensors (``o/<name>/<key>``),
    local shards, in parameter order."""
    out: dict[str, torch.Tensor] = {}
    for name, p in module.named_parameters():
        out[f"p/{name}"] = local(p.detach())
    for name, p in module.named_parameters():
        for key, value in optimizer.state.get(p, {}).items():
            if torch.is_tensor(value):
                out[f"o/{name}/{key}"] = local(value)
    return out


def load_state_tensors(module: torch.nn.Module, optimizer: torch.optim.Optimizer,
                       tensors: Mapping[str, torch.Tensor]) -> None:
    """Copy :func:`state_tensors` of a peer (same layout) into ``module`` and ``optimizer``:
    parameters in place; optimizer state replaced (none sent: a fresh optimizer)."""
    params = dict(module.named_parameters())
    with torch.no_grad():
        for name, p in params.items():
            local(p).copy_(tensors[f"p/{name}"])
            p.grad = None
        optimizer.state.clear()
        for key, t in tensors.items():
            if not key.startswith("o/"):
                continue
            name, field = key[2:].rsplit("/", 1)
            p = params[name]
            if t.dim() == 0:                     # Adam's step count stays where Adam keeps it
                optimizer.state[p][field] = t.clone()
            else:
                value = torch.zeros_like(p.detach())
                local(value).copy_(t)
                optimizer.state[p][field] = value


def send_state(module: torch.nn.Module, optimizer: torch.optim.Optimizer, owner: Any,
               spec: SyncSpec, version: int) -> int:
    """Broadcast this rank's :func:`state_tensors` of ``version`` to the pair's joiner.
    Returns bytes sent."""
    groups = sync_groups(owner, COLLECTIVES, limit=GROUP_LIMIT)
    sent = groups.send(spec, state_tensors(module, optimizer), version)
    traffic["state_out"] += sent
    return sent


class PeerTransferError(RuntimeError):
    """A state transfer from a holder broke before anything was loaded (the holder's end was
    lost mid-way, or their group never formed): the receiving rank holds its old state."""


def transfer_broke(exc: BaseException) -> bool:
    """Whether ``exc`` (a failed call, however wrapped: Ray task errors carry the method's
    error as ``cause``) is a :class:`PeerTransferError`."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, PeerTransferError):
            return True
        seen.add(id(exc))
        exc = getattr(exc, "cause", None) or exc.__cause__
    return False


def receive_state(module: torch.nn.Module, optimizer: torch.optim.Optimizer, owner: Any,
                  spec: SyncSpec, version: int) -> None:
    """Receive a holder's :func:`send_state` of ``version`` and load it.

    Raises:
        PeerTransferError: the transfer broke; nothing was loaded.
    """
    groups = sync_groups(owner, COLLECTIVES, limit=GROUP_LIMIT)
    try:
        tensors = groups.receive(spec, version)
    except Exception as exc:  # noqa: BLE001 - a lost peer shows as gloo / store / timeout errors
        raise PeerTransferError(f"the state of version {version} from its holder did not "
                                f"arrive: {exc!r}") from exc
    traffic["state_in"] += nbytes(tensors)
    load_state_tensors(module, optimizer, tensors)
