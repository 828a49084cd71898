"""Context parallelism for tree rows: one packed tree row split by token ranges over ranks.

A context-parallel group of ``size`` ranks trains one *row* (a data-parallel group's rows,
concatenated: :func:`join_rows`) cut into ``size`` equal column ranges; rank ``r`` holds columns
``[r·W, (r+1)·W)`` (``W = ⌈n / size⌉``; the last range is padded) and runs the whole model on
them — embeddings, MLPs, norms and the head see only its tokens::

    row        sys u1 >a1 >a2 t1 >b1 S >s1 >s2 >x1 ·  ·      n = 10, size = 3, W = 4
    rank 0     sys u1 >a1 >a2                                 pieces [0,3) · [3,4)
    rank 1                    t1 >b1 S >s1                    pieces [4,8): prefix (0,4)
    rank 2                                >s2 >x1 ·  ·        [8,9): (0,8) · [9,10): (0,3)

Attention, per layer (:class:`ContextParallelPlan`): the group all-gathers every rank's keys
and values (``W`` columns each), then each rank runs its pieces — segments of the tree cut at
its range — with the split-KV driver of ``split_kv.py`` (prefix in full + self causal, merged by
logsumexp; the same kernels as one device). Only the local keys and values are kept for
backward; backward all-gathers them again, runs the split-KV backward over the whole row's
keys and reduce-scatters (sums) the key/value gradients back to their owners. Each rank's
loss is the loss of its own targets (those predicted from its columns), so the ranks' losses
and parameter gradients add up to one device's (FSDP's sum reduction, or any all-reduce).

Memory per rank: activations of ``W`` tokens, plus per layer in flight one gathered copy of the
row's keys and values (``2 · n · H_kv · D``) — the ring exchange would bound this by ``W`` too
at the price of ``size`` rounds per layer; the all-gather is what is built.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist

from ray_xlong.trajectory.packing import PackedBatch
from ray_xlong.trajectory.split_kv import (Piece, attend_pieces, attend_pieces_backward,
                                          kernel_for, tree_pieces)


class ContextParallelError(ValueError):
    """A context-parallel split that cannot be made (the message names both numbers)."""


@dataclasses.dataclass(frozen=True, slots=True)
class ContextParallelPlan:
    """One rank's share of a context-parallel row (``tree_plan=`` of an ``xlong_tree`` model)."""

    pieces: tuple[Piece, ...]
    """This rank's query pieces, in row columns (row 0)."""
    start: int
    """First row column this rank holds (``rank · width``)."""
    width: int
    """Columns per rank (every rank holds ``width``, the last one padded)."""
    rank: int
    """Rank in the context-parallel group."""
    size: int
    """Ranks in the group."""
    group: Any = None
    """The ``torch.distributed`` process group of the context-parallel ranks (None: the
    default group)."""

    def attend(self, query, key, value, *, scale: float) -> torch.Tensor:
        """``[1, H, width, D]`` attention of this rank's queries over the whole row."""
        return _ContextParallelAttention.apply(query, key, value, self, float(scale))


def _gather(t: torch.Tensor, plan: ContextParallelPlan) -> torch.Tensor:
    """The row's ``[1, H, size · width, D]`` from every rank's ``[1, H, width, D]``."""
    parts = [torch.empty_like(t) for _ in range(plan.size)]
    dist.all_gather(parts, t.contiguous(), group=plan.group)
    return torch.cat(parts, dim=2)


def _scatter_sum(t: torch.Tensor, plan: ContextParallelPlan) -> torch.Tensor:
    """This rank's columns of ``Σ_ranks t`` (``t``: ``[1, H, size · width, D]``)."""
    parts = [c.contiguous() for c in t.split(plan.width, dim=2)]
    out = torch.empty_like(parts[plan.rank])
    dist.reduce_scatter(out, parts, group=plan.group)
    return out


class _ContextParallelAttention(torch.autograd.Function):
    """All-gather K/V → split-KV pieces; backward re-gathers, reduce-scatters dK/dV."""

    @staticmethod
    def forward(ctx, query, key, value, plan: ContextParallelPlan, scale: float):
        kernel = kernel_for(query.device, query.dtype)
        out, lse = attend_pieces(query, _gather(key, plan), _gather(value, plan), plan.pieces,
                                 kernel=kernel, scale=scale, q_offset=plan.start)
        ctx.save_for_backward(query, key, value, out, lse)
        ctx.plan, ctx.scale, ctx.kernel = plan, scale, kernel
        return out

    @staticmethod
    def backward(ctx, grad_out):
        query, key, value, out, lse = ctx.saved_tensors
        plan = ctx.plan
        dq, dk, dv = attend_pieces_backward(grad_out, query, _gather(key, plan),
                                            _gather(value, plan), out, lse, plan.pieces,
                                            kernel=ctx.kernel, scale=ctx.scale,
                                            q_offset=plan.start)
        return dq, _scatter_sum(dk, plan), _scatter_sum(dv, plan), None, None


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


def shard_row(batch: PackedBatch, *, rank: int, size: int,
              group: Any = None) -> tuple[PackedBatch, ContextParallelPlan]:
    """Rank ``rank``'s share of a one-row tree batch (see the module docstring).

    Args:
        batch: one tree row (:func:`join_rows`).
        rank: rank in the context-parallel group, ``0 <= rank < size``.
        size: ranks per row (``LearnerSettings.context_parallel``).
        group: their process group (None: the default group).

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
    width = -(-n // size)
    start, stop = rank * width, (rank + 1) * width
    kv_end = batch.attention_mask[0, :n]
    pieces = tree_pieces(kv_end.cpu().numpy(), lo=start, hi=stop)

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
    return local, ContextParallelPlan(pieces, start, width, rank, size, group)


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
