"""A step's new weights, Learner → engines of the cells not training, in buckets over a process
group (``CellJobConfig.weight_sync='broadcast'``); the driver only coordinates.

```
_finish_step ─► BroadcastWeights.push(pool, sender=lead cell, targets, version)
   key = "<generation>/s<sender>/t<targets>"    one group per (sender, targets) set, made by its
                                                 members on first use, cached by each of them
   sender.learner.send_weights(spec rank 0)  ║  target.runner.receive_weights(spec rank i)  …
        plan into the driver's TCPStore,     ║     plan from the store, buckets in, then
        then one broadcast per bucket        ║     set_weights(whole dict, version) between
                                             ║     engine batches (every engine of an EngineSet)
   driver: ray.get(all of them) — bounded by the group's timeout
   failure ─► generation += 1 (every cached group dropped, the next push makes new ones);
              targets whose runner lives get the weights by the object store (today's path);
              a dead runner / sender is returned for recovery.py to rebuild
```

Why a group per (sender, targets) set, and not one pool-wide group: roles change every step,
so which Learner holds the step's weights (the first member that applied it) and which cells
are rolling out differ from step to step. One group over every cell's runner and learner would
need every member — learners mid micro-batch included — in every collective, or P2P sends
from the sender to each target (N × the sender's bandwidth; a broadcast pipelines on NCCL). A
group of exactly the sync's members needs only them, all of which the sync calls anyway; in
practice a job sees few distinct sets (the same cells keep rolling out), so groups are
reused, and building one is one rendezvous (measured in ``benchmarks/weight_sync.py``).
Any replaced actor (``CellPool.actors_replaced``) or failed sync starts a new generation, so a
group never waits on a dead peer twice.

A cell going back to rollout (``Sync`` → ``runner.resume``), a rebuilt runner and a resumed
driver load the weights from the object store ref the Learner group keeps: the cell's own
Learner rank shares its runner's GPU, where NCCL refuses two ranks on one device and CUDA IPC
belongs (not written).
"""

from __future__ import annotations

import dataclasses
import secrets
from typing import Any, Sequence

import ray

from ray_xlong.cells.learner_group import actor_lost
from ray_xlong.cells.weight_sync import SyncSpec

SCHEMES = ("object_store", "broadcast")
"""``CellJobConfig.weight_sync`` values."""


@dataclasses.dataclass(frozen=True, slots=True)
class PushOutcome:
    """What one broadcast push did."""

    lost: tuple[int, ...]
    """Cells whose runner (or, for the sender's cell, learner) died: recover them."""
    fallback: tuple[int, ...]
    """Targets that got the weights by the object store after the broadcast failed."""
    seconds: float
    """Wall seconds of the push (fallback included)."""
    own: tuple[int, ...] = ()
    """The sender's own cell, when a target: it got them by the object store (same GPU)."""


class BroadcastWeights:
    """The driver's side of the broadcast sync (module docstring): a ``TCPStore`` for the
    groups' rendezvous, the generation, and the push."""

    def __init__(self, *, backend: str = "gloo", timeout_s: float = 60.0,
                 bucket_mb: float = 256.0) -> None:
        import datetime

        import torch.distributed as dist
        from ray.util import get_node_ip_address

        self.backend, self.timeout_s, self.bucket_mb = backend, timeout_s, bucket_mb
        self.host = get_node_ip_address()
        self.store = dist.TCPStore(self.host, 0, None, True,
                                   datetime.timedelta(seconds=timeout_s),
                                   wait_for_workers=False)
        self.port = self.store.port
        self.epoch = f"{self.port}-{secrets.token_hex(3)}"
        """Names this store's groups apart from an earlier driver's on the same cells."""
        self.generation = 0
        self.failures = 0
        self.groups_made: set[str] = set()

    def key(self, pool: Any, sender: int, targets: Sequence[int]) -> str:
        gen = self.generation + pool.actors_replaced
        return f"{gen}/{self.epoch}/s{sender}/t{'.'.join(map(str, targets))}"

    def push(self, pool: Any, *, sender: int | None, targets: Sequence[int], version: int,
             weights_ref: Any) -> PushOutcome:
        """Weights of ``version`` from ``sender``'s learner to the runners of ``targets``
        (``weights_ref``: the same weights in the object store, the fallback; ``sender``
        None: no learner holds them, every target takes the object store). The driver waits
        at most ``2 × timeout_s`` for the broadcast."""
        import time

        t0 = time.perf_counter()
        # The sender's own cell (a member that left training mid-step) shares its runner's GPU:
        # NCCL refuses two ranks on one device, so that cell takes the object store.
        own = [c for c in targets if c == sender or sender is None]
        targets = sorted(c for c in targets if c not in own)
        lost = pool.push_weights(own, weights_ref, version) if own else []
        if not targets:
            return PushOutcome(tuple(lost), (), time.perf_counter() - t0, tuple(own))
        key = self.key(pool, sender, targets)
        self.groups_made.add(key)
        spec = SyncSpec(key, self.host, self.port, 0, len(targets) + 1, self.backend,
                        self.timeout_s, self.bucket_mb)
        send = pool.cells[sender].learner.send_weights.remote(spec, version)
        recv = {c: pool.cells[c].runner.receive_weights.remote(
            dataclasses.replace(spec, rank=i + 1), version) for i, c in enumerate(targets)}
        failed, dead = [], []
        deadline = time.monotonic() + 2 * self.timeout_s      # every call is bounded by it
        sender_ok = self._wait(send, deadline)
        if sender_ok is False:
            dead.append(sender)
        for cell, ref in recv.items():
            ok = self._wait(ref, deadline)
            if ok is False:
                dead.append(cell)
            elif ok is None:
                failed.append(cell)
        if sender_ok is not True or failed or dead:
            self.generation += 1
            self.failures += 1
        if failed:
            dead += pool.push_weights(failed, weights_ref, version)
        return PushOutcome(tuple(dict.fromkeys(lost + dead)), tuple(failed),
                           time.perf_counter() - t0, tuple(own))

    @staticmethod
    def _wait(ref: Any, deadline: float) -> bool | None:
        """True: done; False: its actor died; None: it failed otherwise (timeout, a peer
        gone from the group)."""
        import time

        try:
            ray.get(ref, timeout=max(0.1, deadline - time.monotonic()))
            return True
        except ray.exceptions.GetTimeoutError:
            return None
        except ray.exceptions.RayError as exc:
            return False if actor_lost(exc) else None


def broadcast_sync(config: Any) -> BroadcastWeights | None:
    """A :class:`BroadcastWeights` for a ``CellJobConfig`` whose ``weight_sync_scheme`` is
    ``broadcast`` (NCCL with ``sharding.device='cuda'``), else None (the object store)."""
    if config.weight_sync_scheme != "broadcast":
        return None
    return BroadcastWeights(backend=config.sharding.backend,
                            timeout_s=config.weight_sync_timeout_s,
                            bucket_mb=config.weight_sync_bucket_mb)
