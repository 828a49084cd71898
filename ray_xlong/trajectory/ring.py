"""Ring exchange of a context-parallel group: ancestor keys and values passed rank to rank.

``exchange="ring"`` of :mod:`context_parallel`: instead of all-gathering every rank's sent spans
at once, each rank's block (the same spans, padded to the largest rank's share) travels round
the group with point-to-point sends. Per layer, on rank ``r`` of ``size``::

    round 0        own keys: local pieces (self causal + the prefix ranges this rank holds)
    round k ≥ 1    holds the block of rank (r − k) mod size; attends the parts of its pieces'
                   prefix ranges that fall in it (none: nothing computed), merges by logsumexp
    rounds         R = the largest rank distance any piece of the group needs (a trunk on
                   rank 0: size − 1; no crossing ancestor: 0, no communication at all)

While a round computes, the next block is being received: two foreign blocks in memory at most.
Backward runs the same ring, recomputing nothing but each part's kernel backward with the
merged output and logsumexp (``split_kv.py``'s identity); a block travels with its key/value
gradients accumulating, and after round ``R`` the holder sends them straight back to the owner
(one more point-to-point message), who adds them to its own columns' gradients.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist

from ray_xlong.trajectory.split_kv import (Piece, Ranges, _merge, _prefix, attend_pieces,
                                          attend_pieces_backward, kernel_for)


@dataclasses.dataclass(frozen=True, slots=True)
class RingPart:
    """Queries ``[start, stop)`` (local columns) over ``ranges`` of a visiting block (in full)."""

    start: int
    """First query column of this rank."""
    stop: int
    """One past the last query column."""
    ranges: Ranges
    """Columns of the visiting block (ascending, disjoint)."""


@dataclasses.dataclass(frozen=True, slots=True)
class RingSchedule:
    """One rank's ring: what it computes in each round and what its block holds."""

    local: tuple[Piece, ...]
    """Round 0: this rank's pieces in local columns, prefixes cut to the columns it holds."""
    rounds: tuple[tuple[RingPart, ...], ...]
    """Rounds ``1 … R``: the parts over the block of rank ``(rank − k) mod size``."""
    send: Ranges
    """Local columns of this rank's block (what some other rank needs), in order."""
    block: int
    """Columns of every block (the largest rank's share; blocks are padded to it)."""
    rank: int
    """Rank in the group."""
    size: int
    """Ranks in the group."""
    group: Any = None
    """The process group (None: the default group)."""


def ring_schedule(pieces: tuple[Piece, ...], sends, *, rank: int, size: int, width: int,
                  rounds: int, group: Any = None) -> RingSchedule:
    """The ring of rank ``rank`` from its ``pieces`` (row columns) and every rank's sent ranges
    ``sends`` (row columns, ascending; :func:`context_parallel._exchange` with ``spans``)."""
    start = rank * width

    def block_of(owner: int, a: int, b: int) -> list[tuple[int, int]]:
        """Row columns ``[a, b)`` of ``owner`` as columns of its block (all must be sent)."""
        out, at = [], 0
        for lo, hi in sends[owner]:
            if max(a, lo) < min(b, hi):
                out.append((at + max(a, lo) - lo, at + min(b, hi) - lo))
            at += hi - lo
        if sum(y - x for x, y in out) != b - a:
            raise AssertionError(f"rank {owner} does not send columns [{a}, {b}) rank {rank} "
                                 f"needs")
        return out

    local, parts = [], [[] for _ in range(rounds)]
    for p in pieces:
        mine, theirs = [], [[] for _ in range(rounds)]
        for a, b in p.prefix:
            for owner in range(a // width, (b - 1) // width + 1):
                lo, hi = max(a, owner * width), min(b, (owner + 1) * width)
                if owner == rank:
                    mine.append((lo - start, hi - start))
                else:
                    theirs[(rank - owner) % size - 1].extend(block_of(owner, lo, hi))
        local.append(Piece(0, p.start - start, p.stop - start, tuple(mine)))
        for k, ranges in enumerate(theirs):
            if ranges:
                parts[k].append(RingPart(p.start - start, p.stop - start, tuple(ranges)))
    send = tuple((lo - start, hi - start) for lo, hi in sends[rank])
    block = max(sum(hi - lo for lo, hi in s) for s in sends)
    return RingSchedule(tuple(local), tuple(tuple(x) for x in parts), send, max(block, 1),
                        rank, size, group)


def ring_rounds(pieces_per_rank, width: int, size: int) -> int:
    """``R``: the largest rank distance ``(r − owner) mod size`` of any foreign prefix column."""
    far = 0
    for r, pieces in enumerate(pieces_per_rank):
        for p in pieces:
            for a, b in p.prefix:
                for owner in range(a // width, (b - 1) // width + 1):
                    far = max(far, (r - owner) % size)
    return far


def ring_attention(query, key, value, ring: RingSchedule, *, scale: float) -> torch.Tensor:
    """``[1, H, width, D]`` attention of this rank's queries over their ancestors (the ring)."""
    return _RingAttention.apply(query, key, value, ring, float(scale))


def _pack(key, value, ring: RingSchedule, grads: bool) -> torch.Tensor:
    """This rank's block ``[2 or 4, Hk, block, D]``: keys, values (and zero gradients)."""
    parts = [torch.cat([t[:, :, lo:hi] for lo, hi in ring.send] or [t[:, :, :0]], dim=2)
             for t in (key, value)]
    out = key.new_zeros(4 if grads else 2, key.shape[1], ring.block, key.shape[3])
    for i, t in enumerate(parts):
        out[i, :, :t.shape[2]] = t[0]
    return out


def _shift(ring: RingSchedule, send: torch.Tensor | None, to: int, recv: torch.Tensor | None,
           source: int, tag: int) -> list:
    """Post a send of ``send`` to group rank ``to`` and a receive into ``recv`` from ``source``
    (either may be None); returns the works to wait on."""
    works = []
    if recv is not None:
        works.append(dist.irecv(recv, group=ring.group, group_src=source % ring.size, tag=tag))
    if send is not None:
        works.append(dist.isend(send, group=ring.group, group_dst=to % ring.size, tag=tag))
    return works


def _wait(works: list) -> None:
    for w in works:
        w.wait()


class _RingAttention(torch.autograd.Function):
    """Round 0 local, rounds ``1 … R`` over visiting blocks; backward returns dK/dV home."""

    @staticmethod
    def forward(ctx, query, key, value, ring: RingSchedule, scale: float):
        kernel = kernel_for(query.device, query.dtype)
        r, rounds = ring.rank, len(ring.rounds)
        works, nxt = [], None
        if rounds:
            cur = _pack(key, value, ring, grads=False)
            nxt = torch.empty_like(cur)
            works = _shift(ring, cur, r + 1, nxt, r - 1, 0)
        out, lse, local_aux = attend_pieces(query, key, value, ring.local, kernel=kernel,
                                            scale=scale)
        aux = []
        for k, parts in enumerate(ring.rounds, start=1):
            _wait(works)
            cur, nxt, works = nxt, None, []
            if k < rounds:
                nxt = torch.empty_like(cur)
                works = _shift(ring, cur, r + 1, nxt, r - 1, k)
            aux.append([])
            for p in parts:
                sl = slice(p.start, p.stop)
                o, part_lse, extra = kernel.forward(query[:, :, sl], _prefix(cur[0:1], 0, p.ranges),
                                                    _prefix(cur[1:2], 0, p.ranges), False, scale)
                out[:, :, sl], lse[:, :, sl] = _merge(o, part_lse, out[:, :, sl], lse[:, :, sl])
                aux[-1].append(extra)
        ctx.save_for_backward(query, key, value, out, lse)
        ctx.ring, ctx.scale, ctx.kernel, ctx.aux = ring, scale, kernel, (local_aux, aux)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        query, key, value, out, lse = ctx.saved_tensors
        ring, kernel, scale = ctx.ring, ctx.kernel, ctx.scale
        local_aux, aux = ctx.aux
        r, rounds = ring.rank, len(ring.rounds)
        grad_out = grad_out.contiguous()
        works, nxt = [], None
        if rounds:
            cur = _pack(key, value, ring, grads=True)
            nxt = torch.empty_like(cur)
            works = _shift(ring, cur, r + 1, nxt, r - 1, 0)
        dq, dk, dv = attend_pieces_backward(grad_out, query, key, value, out, lse, ring.local,
                                            local_aux, kernel=kernel, scale=scale)
        for k, parts in enumerate(ring.rounds, start=1):
            _wait(works)
            cur, nxt, works = nxt, None, []
            if k < rounds:                         # receive the next block while computing
                nxt = torch.empty_like(cur)
                works = _shift(ring, None, 0, nxt, r - 1, k)
            for p, extra in zip(parts, aux[k - 1]):
                sl = slice(p.start, p.stop)
                gq, gk, gv = kernel.backward(grad_out[:, :, sl], query[:, :, sl],
                                             _prefix(cur[0:1], 0, p.ranges),
                                             _prefix(cur[1:2], 0, p.ranges), out[:, :, sl],
                                             lse[:, :, sl], False, scale, extra)
                dq[:, :, sl] += gq
                at = 0
                for lo, hi in p.ranges:
                    cur[2, :, lo:hi] += gk[0, :, at:at + hi - lo]
                    cur[3, :, lo:hi] += gv[0, :, at:at + hi - lo]
                    at += hi - lo
            if k < rounds:                         # pass it on with its gradients so far
                works += _shift(ring, cur, r + 1, None, 0, k)
        if rounds:                                 # the holder returns each block's gradients
            _wait(works)
            home = torch.empty_like(cur[2:])
            _wait(_shift(ring, cur[2:].contiguous(), r - rounds, home, r + rounds, rounds + 1))
            at = 0
            for lo, hi in ring.send:
                dk[0, :, lo:hi] += home[0, :, at:at + hi - lo]
                dv[0, :, lo:hi] += home[1, :, at:at + hi - lo]
                at += hi - lo
        return dq, dk, dv, None, None
