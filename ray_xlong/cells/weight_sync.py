"""Learner → engines weight sync in buckets over a process group, never through the driver.

```
sender (training cell rank 0)              receivers (each rollout cell's runner)
plan = bucket_plan(names, shapes, dtypes)  same plan (from the same model: shapes agree)
for bucket in plan:                        for bucket in plan:
  flat = cat(tensors of bucket)  ──bcast──►  flat = empty(bucket bytes); unflatten → names
                                             engine.update_weights(part)   (or collect all)
```

One collective per bucket (``bucket_mb`` caps its size). A receiver on a GPU copies each bucket
to host memory as soon as it landed (``SyncGroups.receive``): the device holds one bucket at a
time, never a staging copy of the whole model, and nothing of a previous sync stays on it; the
engine then loads the host tensors bucket by bucket (``VLLMEngine`` in one vLLM layerwise
reload session). On CPU the group is gloo (tested here); on GPU it is NCCL — written against
torch's ``ProcessGroupNCCL``, checked by ``benchmarks/gpu_check.py --torch-only`` on a GPU.

Every collective is waited for on the CPU with a deadline (:func:`land`): the wait polls the
work's completion, then synchronises the device's current stream before anyone reads the
bucket. ``Work.wait()`` alone orders only the calling thread's current stream on NCCL, while
the weights are read by other threads (the engine's batch thread): without the stream sync a
reader can see a bucket NCCL has not written yet. When the deadline passes (a peer lost
mid-sync), the group is aborted (``ProcessGroupNCCL.abort()``) before NCCL's own watchdog
timeout: the watchdog would otherwise tear down the surviving process
(``TORCH_NCCL_ASYNC_ERROR_HANDLING``), and the driver's object-store fallback
(``cells/broadcast.py``) could not reach it. The sync group's NCCL timeout is therefore set
well past the deadline, and it is built with ``TORCH_NCCL_ASYNC_ERROR_HANDLING=2`` (clean up
the communicator, keep the process): ``ProcessGroupNCCL`` reads that variable in its
constructor (default 3, SkipCleanUp: the process is killed), so it applies to this group only,
not to the cell's FSDP group.

vLLM's own weight-transfer engines (``vllm.distributed.weight_transfer``: NCCL, CUDA IPC) are
not used for the transfer: they live inside vLLM's workers, are set up once per engine with a
fixed trainer group (``init_weight_transfer_engine``), and need CUDA (PyNccl), while a sync
group here is made per (sender, targets) set, changes with the cells' roles, and must run on
gloo on CPU. The load side follows their lifecycle (``initialize_layerwise_reload`` → per
bucket ``load_weights`` → ``finalize_layerwise_reload``). Where Learner and engine share a
device (colocated), CUDA IPC (vLLM's ``IPCWeightTransferEngine``) is where a copy-free path
belongs; not written.

Inside a job (``CellJobConfig.weight_sync='broadcast'``, ``cells/broadcast.py`` drives it) the
group is a :class:`SyncSpec`: the sender (a Learner that applied the step) and the runners of the
target cells, made on first need and cached by each member under the spec's key
(:class:`SyncGroups`), apart from any default process group (a sharded cell's rank 0 already
has its cell's FSDP group): a ``ProcessGroupGloo`` / ``ProcessGroupNCCL`` on a ``TCPStore`` the
driver hosts (rendezvous only: no tensor goes through it). The sender puts the bucket plan in
that store, so the receivers need no model of their own to agree on it. Every collective is
bounded by ``SyncSpec.timeout_s``: a member lost mid-sync fails the others' calls, never hangs
them. An actor that takes part in syncs holds its groups with :func:`sync_groups` (made on
first use, one per actor).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import os
import pickle
import threading
import time
from typing import Any, Callable, Iterator, Mapping

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


class SyncTimeout(RuntimeError):
    """A collective of a sync group did not complete by its deadline (a peer is gone)."""


STREAM_SYNC: dict[str, Callable[[torch.device], None]] = {
    "cuda": lambda device: torch.cuda.current_stream(device).synchronize()}
"""How :func:`land` makes a landed bucket visible to every thread, per device type (CPU
tensors need nothing: gloo writes them before its work completes)."""


def land(work: Any, flat: torch.Tensor, *, timeout_s: float | None) -> None:
    """Wait for ``work`` (the collective that fills or reads ``flat``) on the CPU, at most
    ``timeout_s`` seconds (None: no bound), then synchronise ``flat``'s device stream so that
    any thread may read it.

    Raises:
        SyncTimeout: not complete by the deadline (the caller aborts the group).
    """
    if timeout_s is not None:
        deadline, delay = time.monotonic() + timeout_s, 1e-4
        while not work.is_completed():
            if time.monotonic() > deadline:
                raise SyncTimeout(f"weight sync collective not complete after {timeout_s:g} s "
                                  f"(SyncSpec.timeout_s): a peer is gone")
            time.sleep(delay)           # polling a CUDA event / gloo flag, not synchronising
            delay = min(2 * delay, 0.02)
    work.wait()                         # re-raises the collective's own error (gloo)
    sync = STREAM_SYNC.get(flat.device.type)
    if sync is not None:
        sync(flat.device)


def send(state_dict: Mapping[str, torch.Tensor], plan: list[Bucket], *, src: int = 0,
         group: dist.ProcessGroup | None = None, device: str = "cpu",
         timeout_s: float | None = None) -> int:
    """Broadcast ``state_dict`` bucket by bucket from rank ``src``; each bucket has landed
    (:func:`land`) before the next is built. Returns bytes sent."""
    sent = 0
    for bucket in plan:
        flat = torch.cat([state_dict[n].detach().reshape(-1).to(device, bucket.dtype)
                          for n in bucket.names])
        land(_broadcast(flat, src, group), flat, timeout_s=timeout_s)
        sent += flat.numel() * flat.element_size()
    return sent


def receive(plan: list[Bucket], *, src: int = 0, group: dist.ProcessGroup | None = None,
            device: str = "cpu", timeout_s: float | None = None, to_host: bool = False
            ) -> Iterator[dict[str, torch.Tensor]]:
    """Receive :func:`send`'s buckets; yields each as ``{name: tensor}`` once it has landed
    (:func:`land`): views into the bucket's flat buffer, on ``device``, or with ``to_host`` a
    host copy (the device buffer is freed before the next bucket)."""
    for bucket in plan:
        flat = torch.empty(bucket.numel, dtype=bucket.dtype, device=device)
        land(_broadcast(flat, src, group), flat, timeout_s=timeout_s)
        if to_host and flat.device.type != "cpu":
            flat = flat.to("cpu")
        parts, start = {}, 0
        for name, shape in zip(bucket.names, bucket.shapes):
            n = int(torch.Size(shape).numel())
            parts[name] = flat[start:start + n].view(shape)
            start += n
        del flat
        yield parts


def _broadcast(flat: torch.Tensor, src: int, group: Any) -> Any:
    """Start ``dist.broadcast`` of ``flat`` on the default or a registered group, or on a group
    made outside ``torch.distributed``'s registry (:class:`SyncGroups`) with the group's own
    call. Returns its work (:func:`land` waits for it)."""
    if group is None or group in dist.distributed_c10d._world.pg_map:
        return dist.broadcast(flat, src=src, group=group, async_op=True)
    opts = dist.BroadcastOptions()
    opts.rootRank, opts.rootTensor = src, 0
    return group.broadcast([flat], opts)


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


NCCL_TIMEOUT_FACTOR = 4.0
"""A sync group's own NCCL timeout is this × ``SyncSpec.timeout_s``: :func:`land` gives up and
aborts the group first, so NCCL's watchdog never sees the timeout (module docstring)."""


@contextlib.contextmanager
def _nccl_keeps_process() -> Iterator[None]:
    """``TORCH_NCCL_ASYNC_ERROR_HANDLING=2`` (CleanUpOnly: abort the communicator, keep the
    process) while a sync group is built (Ray's torch setup sets 1, TearDown, process-wide)."""
    old = os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING")
    os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "2"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("TORCH_NCCL_ASYNC_ERROR_HANDLING", None)
        else:
            os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = old


def abort_group(pg: Any) -> None:
    """Abort ``pg`` (NCCL: ``ProcessGroupNCCL.abort()``, which frees its communicators without
    waiting for peers), or shut it down where it has no abort; a group that refuses both is
    dropped anyway."""
    for name in ("abort", "shutdown"):
        call = getattr(pg, name, None)
        if call is None:
            continue
        try:
            call()
            return
        except Exception:  # noqa: BLE001 - a broken group may refuse; try the next way
            continue


class SyncGroups:
    """A member's sync groups by key (made on first use; a newer generation drops the older
    ones, whose peers may be dead; beyond ``limit`` groups the least recently used one is shut
    down, so a member of many changing sets holds a bounded number of groups)."""

    def __init__(self, *, limit: int | None = None) -> None:
        self.groups: dict[str, tuple[Any, Any]] = {}
        """By key, least recently used first."""
        self.limit = limit
        """Most groups kept (None: no bound)."""
        self.aborted = 0
        """Groups aborted after a failed or timed-out collective."""

    def group(self, spec: SyncSpec) -> tuple[Any, Any]:
        """``(process group, its prefix store)`` of ``spec`` (collective on first use: every
        member of the spec must call it)."""
        for key in [k for k in self.groups if int(k.split("/", 1)[0]) < spec.generation]:
            self.drop(key)
        if spec.key in self.groups:
            self.groups[spec.key] = self.groups.pop(spec.key)      # most recently used
        else:
            self.groups[spec.key] = _make_group(spec)
        while self.limit is not None and len(self.groups) > self.limit:
            self.drop(next(iter(self.groups)))
        return self.groups[spec.key]

    def drop(self, key: str) -> None:
        """Forget group ``key`` and abort it (after a failure its peers may be gone)."""
        pg, _ = self.groups.pop(key, (None, None))
        if pg is not None:
            abort_group(pg)

    def send(self, spec: SyncSpec, state_dict: Mapping[str, torch.Tensor], version: int
             ) -> int:
        """Rank 0: the plan of ``state_dict`` into the store, then its buckets. Bytes sent."""
        pg, store = self.group(spec)
        plan = bucket_plan(state_dict, bucket_mb=spec.bucket_mb)
        store.set(f"plan/{version}", pickle.dumps(plan))
        try:
            return send(state_dict, plan, group=pg, device=spec.device, timeout_s=spec.timeout_s)
        except Exception:
            self._abort(spec.key)
            raise

    def receive(self, spec: SyncSpec, version: int) -> dict[str, torch.Tensor]:
        """Rank ≥ 1: the sender's state dict of ``version``, whole, in host memory (each
        bucket copied off the device as it lands: module docstring)."""
        pg, store = self.group(spec)
        try:
            plan = pickle.loads(store.get(f"plan/{version}"))
            out: dict[str, torch.Tensor] = {}
            for part in receive(plan, group=pg, device=spec.device, timeout_s=spec.timeout_s,
                                to_host=True):
                out.update(part)
            return out
        except Exception:
            self._abort(spec.key)
            raise

    def _abort(self, key: str) -> None:
        self.aborted += 1
        self.drop(key)


def _make_group(spec: SyncSpec) -> tuple[Any, Any]:
    """A ``ProcessGroupGloo`` / ``ProcessGroupNCCL`` of ``spec`` on the driver's store.

    Raises:
        SyncTimeout: a gloo group's members did not all connect within ``spec.timeout_s`` (a
            member lost after it published its address: gloo's own connect can wait on it
            far longer, holding this actor — and every call queued behind it — meanwhile).
    """
    timeout = datetime.timedelta(seconds=spec.timeout_s)
    store = dist.PrefixStore(spec.key, dist.TCPStore(spec.host, spec.port, None, False, timeout))
    if spec.backend != "nccl":
        return _bounded(lambda: dist.ProcessGroupGloo(store, spec.rank, spec.world, timeout),
                        spec), store
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = timeout * NCCL_TIMEOUT_FACTOR
    with _nccl_keeps_process():
        return dist.ProcessGroupNCCL(store, spec.rank, spec.world, opts), store


def _bounded(make: Callable[[], Any], spec: SyncSpec, *, margin_s: float = 5.0) -> Any:
    """``make()`` (a group's creation) in a thread, waited for ``spec.timeout_s`` + ``margin_s``;
    a group that connects after that is aborted where it was made."""
    box: dict[str, Any] = {}
    done = threading.Event()
    gave_up = threading.Event()

    def run() -> None:
        try:
            box["group"] = make()
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting caller
            box["error"] = exc
        done.set()
        if gave_up.is_set() and "group" in box:
            abort_group(box["group"])

    threading.Thread(target=run, name=f"group-{spec.key}", daemon=True).start()
    if not done.wait(spec.timeout_s + margin_s):
        gave_up.set()
        raise SyncTimeout(f"process group {spec.key}: rank {spec.rank} of {spec.world} not "
                          f"connected after {spec.timeout_s + margin_s:g} s (a member lost?)")
    if "error" in box:
        raise box["error"]
    return box["group"]


def sync_groups(owner: Any, name: str = "weights", *, limit: int | None = None
                ) -> SyncGroups:
    """``owner``'s :class:`SyncGroups` named ``name``, made on first use (with ``limit``) and
    kept on ``owner``: the one place an actor (a Learner, a runner, an engine actor, a sharded
    rank) gets its process groups — ``weights`` for the weight syncs, ``collectives`` for the
    groups between cells (``cells/collectives.py``), each with its own generations."""
    attr = "_sync_groups" if name == "weights" else f"_sync_groups_{name}"
    groups = getattr(owner, attr, None)
    if groups is None:
        groups = SyncGroups(limit=limit)
        setattr(owner, attr, groups)
    return groups
