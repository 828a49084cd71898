"""Context parallelism for tree rows: one packed tree row split by token ranges over ranks.

A context-parallel group of ``size`` ranks trains one *row* (a data-parallel group's rows,
concatenated: :func:`join_rows`) cut into ``size`` equal column ranges; rank ``r`` holds columns
``[r·W, (r+1)·W)`` (``W = ⌈n / size⌉``; the last range is padded) and runs the whole model on
them — embeddings, MLPs, norms and the head see only its tokens::

    row        sys u1 >a1 >a2 t1 >b1 S >s1 >s2 >x1 ·  ·      n = 10, size = 3, W = 4
    rank 0     sys u1 >a1 >a2                                 pieces [0,3) · [3,4)
    rank 1                    t1 >b1 S >s1                    pieces [4,8): prefix (0,4)
    rank 2                                >s2 >x1 ·  ·        [8,9): (0,8) · [9,10): (0,3)

Attention, per layer (:class:`ContextParallelPlan`): every rank's pieces — segments of the
tree cut at its range — need its own keys and *ancestor spans* held by other ranks (a tree's
trunk, the start of a segment that crosses a boundary). The plan knows every rank's pieces
(they follow from ``kv_end``), so the group exchanges just the union of spans some rank needs
from another: passed round a ring (``exchange="ring"``, the default, below) or all-gathered
(``exchange="spans"``, padded to the largest rank's share), or every rank's whole range
(``exchange="all"``). With the all-gathers each rank then attends over its *context* — its own
columns and the received spans, in row order — with the split-KV driver of ``split_kv.py``
(prefix in full + self causal, merged by logsumexp; the same kernels as one device). Only the
local keys and values are kept for backward; backward gathers them again, runs the split-KV
backward and reduce-scatters (sums) the received spans' key/value gradients back to their
owners. Each rank's loss is the loss of its own targets (those predicted from its columns), so
the ranks' losses and parameter gradients add up to one device's (FSDP's sum reduction, or any
all-reduce).

``exchange="ring"`` (``ring.py``) sends the same spans as ``spans`` but one rank's block at a
time, passed round the group point to point: in round ``k`` rank ``r`` attends the parts of its
pieces' prefixes held by rank ``(r − k) mod size`` and merges by logsumexp; backward passes the
blocks round again with their key/value gradients accumulating, then returns those to the owner.

Memory per rank: activations of ``W`` tokens, plus per layer in flight the gathered spans
(``spans``: every rank's block of ancestors that cross ranks, e.g. a trunk; ``all``: the whole
row's keys and values; ``ring``: two blocks, the one attended and the one arriving).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist

from ray_xlong.trajectory.packing import PackedBatch
from ray_xlong.trajectory.ring import RingSchedule, ring_attention, ring_rounds, ring_schedule
from ray_xlong.trajectory.split_kv import (Piece, Ranges, attend_pieces,
                                          attend_pieces_backward, kernel_for, tree_pieces)


class ContextParallelError(ValueError):
    """A context-parallel split that cannot be made (the message names both numbers)."""


EXCHANGES = ("spans", "all", "ring")
"""How a group exchanges keys and values: ``spans`` (all-gather the ancestor spans some rank of
the group needs from another), ``all`` (all-gather every rank's whole range) or ``ring`` (the
same spans as ``spans``, one rank's block at a time passed round the group: ``ring.py``)."""


@dataclasses.dataclass(frozen=True, slots=True)
class ContextParallelPlan:
    """One rank's share of a context-parallel row (``tree_plan=`` of an ``xlong_tree`` model).

    Keys and values are attended in *context* columns: this rank's own ``width`` columns and
    the spans received from the others, in row order (``blocks``); ``pieces`` are in those
    columns."""

    pieces: tuple[Piece, ...]
    """This rank's query pieces, in context columns (row 0)."""
    start: int
    """First row column this rank holds (``rank · width``)."""
    width: int
    """Columns per rank (every rank holds ``width``, the last one padded)."""
    rank: int
    """Rank in the context-parallel group."""
    size: int
    """Ranks in the group."""
    spans: tuple[Ranges, ...]
    """Row column ranges each rank of the group sends (what some other rank's pieces need)."""
    q_offset: int
    """Context column of this rank's first column."""
    group: Any = None
    """The ``torch.distributed`` process group of the context-parallel ranks (None: the
    default group)."""
    ring: RingSchedule | None = None
    """``exchange="ring"``: the ring this rank runs (``pieces`` then describe the gathered
    context of ``spans``, unused)."""

    @property
    def send(self) -> Ranges:
        """This rank's sent ranges in local columns."""
        return tuple((lo - self.start, hi - self.start) for lo, hi in self.spans[self.rank])

    @property
    def sizes(self) -> tuple[int, ...]:
        """Columns each rank sends (the exchange pads every block to the largest)."""
        return tuple(sum(hi - lo for lo, hi in spans) for spans in self.spans)

    def context_columns(self) -> list[int]:
        """The row column of every context column (own range whole, others' spans)."""
        cols: list[int] = []
        for r, spans in enumerate(self.spans):
            for lo, hi in ([(self.start, self.start + self.width)] if r == self.rank else spans):
                cols.extend(range(lo, hi))
        return cols

    def attend(self, query, key, value, *, scale: float) -> torch.Tensor:
        """``[1, H, width, D]`` attention of this rank's queries over their ancestors."""
        if self.ring is not None:
            return ring_attention(query, key, value, self.ring, scale=scale)
        return _ContextParallelAttention.apply(query, key, value, self, float(scale))

    def gather(self, t: torch.Tensor) -> torch.Tensor:
        """Context keys (or values) ``[1, H, C, D]`` from this rank's ``[1, H, width, D]``."""
        top = max(max(self.sizes), 1)
        blocks = [torch.empty(*t.shape[:2], top, t.shape[3], dtype=t.dtype, device=t.device)
                  for _ in range(self.size)]
        dist.all_gather(blocks, _pack(t, self.send, top), group=self.group)
        parts = [t if r == self.rank else blocks[r][:, :, :n]
                 for r, n in enumerate(self.sizes) if r == self.rank or n]
        return torch.cat(parts, dim=2)

    def scatter(self, grad: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
        """``local``'s gradient: its own context columns of ``grad`` plus what every other
        rank's ``grad`` holds for the columns this rank sent (a reduce-scatter of sums)."""
        blocks, at, top = [], 0, max(max(self.sizes), 1)
        for r, n in enumerate(self.sizes):
            if r == self.rank:
                out = grad[:, :, at:at + self.width].clone()
                at += self.width
                blocks.append(grad.new_zeros(*grad.shape[:2], top, grad.shape[3]))
            else:
                blocks.append(_pad(grad[:, :, at:at + n], top))
                at += n
        received = torch.empty_like(blocks[0])
        dist.reduce_scatter(received, [b.contiguous() for b in blocks], group=self.group)
        at = 0
        for lo, hi in self.send:
            out[:, :, lo:hi] += received[:, :, at:at + hi - lo]
            at += hi - lo
        return out


def _pad(t: torch.Tensor, length: int) -> torch.Tensor:
    if t.shape[2] == length:
        return t
    return torch.cat([t, t.new_zeros(*t.shape[:2], length - t.shape[2], t.shape[3])], dim=2)


def _pack(t: torch.Tensor, ranges: Ranges, length: int) -> torch.Tensor:
    """The columns ``ranges`` of ``t``, padded to ``length``."""
    parts = [t[:, :, lo:hi] for lo, hi in ranges]
    body = torch.cat(parts, dim=2) if parts else t[:, :, :0]
    return _pad(body, length).contiguous()


class _ContextParallelAttention(torch.autograd.Function):
    """Gather context K/V → split-KV pieces; backward re-gathers, reduce-scatters dK/dV."""

    @staticmethod
    def forward(ctx, query, key, value, plan: ContextParallelPlan, scale: float):
        kernel = kernel_for(query.device, query.dtype)
        out, lse, ctx.aux = attend_pieces(query, plan.gather(key), plan.gather(value),
                                          plan.pieces, kernel=kernel, scale=scale,
                                          q_offset=plan.q_offset)
        ctx.save_for_backward(query, key, value, out, lse)
        ctx.plan, ctx.scale, ctx.kernel = plan, scale, kernel
        return out

    @staticmethod
    def backward(ctx, grad_out):
        query, key, value, out, lse = ctx.saved_tensors
        plan = ctx.plan
        dq, dk, dv = attend_pieces_backward(grad_out, query, plan.gather(key),
                                            plan.gather(value), out, lse, plan.pieces,
                                            ctx.aux, kernel=ctx.kernel, scale=ctx.scale,
                                            q_offset=plan.q_offset)
        return dq, plan.scatter(dk, key), plan.scatter(dv, value), None, None


def _subtract(ranges: Ranges, lo: int, hi: int) -> list[tuple[int, int]]:
    """``ranges`` minus ``[lo, hi)``."""
    out = []
    for a, b in ranges:
        if a < lo:
            out.append((a, min(b, lo)))
        if b > hi:
            out.append((max(a, hi), b))
    return [(a, b) for a, b in out if a < b]


def _union(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[list[int]] = []
    for a, b in sorted(ranges):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def _clip(ranges: list[tuple[int, int]], lo: int, hi: int) -> list[tuple[int, int]]:
    return [(max(a, lo), min(b, hi)) for a, b in ranges if max(a, lo) < min(b, hi)]


def _exchange(kv_end, n: int, width: int, size: int, exchange: str):
    """Per rank: the row columns it sends (ascending ranges), and every rank's pieces."""
    pieces = [tree_pieces(kv_end, lo=r * width, hi=(r + 1) * width) for r in range(size)]
    if exchange == "all":
        needed = [(0, n)]
    else:
        needed = _union([span for r, ps in enumerate(pieces) for p in ps
                         for span in _subtract(p.prefix, r * width, (r + 1) * width)])
    sends = [_clip(needed, r * width, min((r + 1) * width, n)) for r in range(size)]
    return sends, pieces


def _to_context(pieces, sends, rank: int, width: int) -> tuple[tuple[Piece, ...], int]:
    """Pieces in context columns: own range whole, other ranks' sent spans, in row order."""
    blocks = []                                    # (row lo, row hi, context lo)
    at = 0
    for r, spans in enumerate(sends):
        for lo, hi in ([(r * width, (r + 1) * width)] if r == rank else spans):
            blocks.append((lo, hi, at))
            at += hi - lo

    def where(col: int) -> int:
        for lo, hi, c in blocks:
            if lo <= col < hi:
                return c + col - lo
        raise AssertionError(f"context column {col} was not exchanged")

    def remap(ranges):
        out = []
        for a, b in ranges:
            for lo, hi, _ in blocks:
                if max(a, lo) < min(b, hi):
                    s, e = max(a, lo), min(b, hi)
                    out.append((where(s), where(s) + e - s))
        return tuple(out)

    own = where(rank * width)
    return tuple(Piece(0, where(p.start), where(p.start) + p.stop - p.start, remap(p.prefix))
                 for p in pieces), own


def join_rows(batch: PackedBatch, rows: list[int]) -> PackedBatch:
    """``rows`` of a tree batch as one row: their real tokens side by side (``kv_end`` and
    target sources shifted by each row's offset; positions unchanged). Runs in different rows
    never attend to each other, exactly as before."""
    if batch.layout != "tree":
        raise ContextParallelError(f"context parallelism splits tree rows; the batch's layout "
                                   f"is {batch.layout!r}")
    lengths = batch.valid.sum(dim=1).tolist()
    offsets, at = {}, 0
    for r in rows:
        offsets[r] = at
        at += int(lengths[r])
    cols = lambda t: torch.cat([t[r, :lengths[r]] for r in rows]).unsqueeze(0)  # noqa: E731
    kv_end = torch.cat([batch.attention_mask[r, :lengths[r]] + offsets[r] for r in rows])
    shift = torch.full((batch.input_ids.shape[0],), -1, dtype=torch.int64)
    for r in rows:
        shift[r] = offsets[r]
    keep = shift[batch.target_row] >= 0
    return PackedBatch("tree", cols(batch.input_ids), cols(batch.position_ids),
                       kv_end.unsqueeze(0), torch.zeros(int(keep.sum()), dtype=torch.int64),
                       batch.target_src[keep] + shift[batch.target_row[keep]],
                       batch.target_ids[keep], batch.behaviour_logprobs[keep],
                       batch.policy_versions[keep], batch.advantages[keep],
                       batch.loss_scale[keep], batch.target_run[keep], batch.run_ids,
                       torch.ones(1, at, dtype=torch.bool))


def shard_row(batch: PackedBatch, *, rank: int, size: int, group: Any = None,
              exchange: str = "ring") -> tuple[PackedBatch, ContextParallelPlan]:
    """Rank ``rank``'s share of a one-row tree batch (see the module docstring).

    Args:
        batch: one tree row (:func:`join_rows`).
        rank: rank in the context-parallel group, ``0 <= rank < size``.
        size: ranks per row (``LearnerSettings.context_parallel``).
        group: their process group (None: the default group).
        exchange: one of :data:`EXCHANGES` (``ring``: the least memory per rank, measured in
            ``docs/long-context.md``).

    Returns:
        ``(local batch, plan)``: the local batch holds columns ``[start, start + width)``
        (padding after the row's end) and the targets predicted from them (sources shifted to
        local columns, canonical order kept); pass the plan as ``tree_plan``.

    Raises:
        ContextParallelError: more ranks than the row has tokens (both numbers named), or not
            one tree row.
    """
    if batch.layout != "tree" or batch.input_ids.shape[0] != 1:
        raise ContextParallelError(f"shard_row takes one tree row (join_rows); got layout "
                                   f"{batch.layout!r} with {batch.input_ids.shape[0]} rows")
    n = int(batch.valid[0].sum())
    if size > n:
        raise ContextParallelError(f"LearnerSettings.context_parallel={size} exceeds the row: "
                                   f"{size} ranks for a row of {n} tokens")
    if exchange not in EXCHANGES:
        raise ContextParallelError(f"shard_row: exchange must be one of {EXCHANGES}, "
                                   f"got {exchange!r}")
    width = -(-n // size)
    start, stop = rank * width, (rank + 1) * width
    sends, pieces = _exchange(batch.attention_mask[0, :n].cpu().numpy(), n, width, size,
                              exchange)
    context, q_offset = _to_context(pieces[rank], sends, rank, width)
    ring = None
    if exchange == "ring":
        ring = ring_schedule(pieces[rank], sends, rank=rank, size=size, width=width,
                             rounds=ring_rounds(pieces, width, size), group=group)

    def cols(t: torch.Tensor, fill) -> torch.Tensor:
        out = t.new_full((1, width), fill)
        part = t[0, start:min(stop, n)]
        out[0, :part.numel()] = part
        return out

    mine = (batch.target_src >= start) & (batch.target_src < stop)
    local = PackedBatch("tree", cols(batch.input_ids, 0), cols(batch.position_ids, 0),
                        cols(batch.attention_mask, 0), torch.zeros_like(batch.target_row[mine]),
                        batch.target_src[mine] - start, batch.target_ids[mine],
                        batch.behaviour_logprobs[mine], batch.policy_versions[mine],
                        batch.advantages[mine], batch.loss_scale[mine], batch.target_run[mine],
                        batch.run_ids, cols(batch.valid, False))
    return local, ContextParallelPlan(context, start, width, rank, size,
                                      tuple(tuple(x) for x in sends), q_offset, group, ring)


def context_groups(world_size: int, size: int) -> list[Any]:
    """Every context-parallel group of the default process group: ranks ``[g·size, (g+1)·size)``
    (``dist.new_group`` is collective: every rank calls this with the same arguments)."""
    check_context_parallel(size, world_size)
    return [dist.new_group(list(range(g * size, (g + 1) * size)))
            for g in range(world_size // size)]


def check_context_parallel(size: int, ranks: int) -> None:
    """Raise :class:`ContextParallelError` unless ``size`` ranks per row divide ``ranks``."""
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ContextParallelError(f"LearnerSettings.context_parallel must be an int >= 1, "
                                   f"got {size!r}")
    if ranks % size:
        raise ContextParallelError(f"LearnerSettings.context_parallel={size} does not divide "
                                   f"the cell's {ranks} Learner ranks "
                                   f"(ShardingSettings.ranks_per_cell={ranks})")
