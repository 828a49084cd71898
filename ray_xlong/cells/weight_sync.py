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
"""

from __future__ import annotations

import dataclasses
from typing import Iterator, Mapping

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
        dist.broadcast(flat, src=src, group=group)
        sent += flat.numel() * flat.element_size()
    return sent


def receive(plan: list[Bucket], *, src: int = 0, group: dist.ProcessGroup | None = None,
            device: str = "cpu") -> Iterator[dict[str, torch.Tensor]]:
    """Receive :func:`send`'s buckets; yields each as ``{name: tensor}`` (load it, or collect
    ``dict(ChainMap)`` of all for a full state dict)."""
    for bucket in plan:
        flat = torch.empty(bucket.numel, dtype=bucket.dtype, device=device)
        dist.broadcast(flat, src=src, group=group)
        parts, start = {}, 0
        for name, shape in zip(bucket.names, bucket.shapes):
            n = int(torch.Size(shape).numel())
            parts[name] = flat[start:start + n].view(shape)
            start += n
        yield parts
