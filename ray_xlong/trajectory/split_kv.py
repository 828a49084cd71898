"""Split-KV tree attention on any device: fused kernels that return the logsumexp, no masks.

A tree row's queries are cut into *pieces* (``tree_attention.py``'s segments, cut again where a
caller needs, e.g. at a context-parallel rank's boundary). A piece ``[a, b)`` attends to its
prefix (ancestor spans, then the earlier part of its own segment) in full and to itself
causally; the prefix is a short list of column *ranges*, never an index tensor::

    piece [a, b)     prefix ranges ((0, 3), (3, a))      self [a, b) causal (square: exact)
    part outputs     o_prefix, lse_prefix  ·  o_self, lse_self       one kernel call each
    merged           lse = logaddexp(lse_prefix, lse_self),  o = Σ o_part · exp(lse_part − lse)

Backward runs each part's kernel backward with the *merged* output and logsumexp (a part's
probabilities are ``exp(s − lse)``), adding into one gradient buffer per tensor. Workspace per
piece: its prefix keys gathered (``torch.cat`` of views, O(depth)), freed after; the plan holds
O(pieces × depth-in-segments) integers on the host and nothing on the device, so mask and
workspace memory are O(tokens). Building a plan syncs the host once (``kv_end`` to the host);
running it never does.

Kernels (:func:`kernel_for`): ``cpu_flash`` (``_scaled_dot_product_flash_attention_for_cpu``),
``cuda_flash`` (``_scaled_dot_product_flash_attention``, half / bfloat16), ``cuda_efficient``
(``_scaled_dot_product_efficient_attention``, float32), and ``math`` (plain torch with the
logsumexp, query-chunked so its score workspace stays ≤ ``math_chunk × keys``; any device,
float64, and the path a CPU test forces so the device-generic driver cannot rot).
Low-precision outputs are merged in float32 and the logsumexp is float32 throughout.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np
import torch

Ranges = tuple[tuple[int, int], ...]


@dataclasses.dataclass(frozen=True, slots=True)
class Piece:
    """Queries ``[start, stop)`` of ``row`` over ``prefix`` (in full) and themselves (causal)."""

    row: int
    """Row of the batch."""
    start: int
    """First query column (row coordinates)."""
    stop: int
    """One past the last query column."""
    prefix: Ranges
    """Visible key columns before ``start`` as ascending, disjoint ``(lo, hi)`` ranges."""

    @property
    def num_prefix(self) -> int:
        """Keys before ``start``."""
        return sum(hi - lo for lo, hi in self.prefix)


def tree_pieces(kv_end: np.ndarray, *, row: int = 0, lo: int = 0,
                hi: int | None = None) -> tuple[Piece, ...]:
    """Pieces of one row's real tokens ``kv_end`` (``[n]``, the tree rule ``j <= i < kv_end[j]``)
    whose queries fall in ``[lo, hi)``; segments crossing ``lo`` / ``hi`` are cut there.

    A stack of open segments (those whose ``kv_end`` lies past the current column) is the
    ancestor list: O(n + pieces × depth-in-segments) host work, no L² anything."""
    n = int(kv_end.shape[0])
    hi = n if hi is None else min(hi, n)
    if n == 0 or lo >= hi:
        return ()
    starts = np.concatenate([[0], np.flatnonzero(kv_end[1:] != kv_end[:-1]) + 1]).tolist()
    stops = starts[1:] + [n]
    ends = kv_end[starts].tolist()
    stack: list[tuple[int, int, int]] = []
    pieces = []
    for a, b, e in zip(starts, stops, ends):
        if a >= hi:
            break
        while stack and stack[-1][2] <= a:
            stack.pop()
        if b > lo:
            pa, pb = max(a, lo), min(b, hi)
            spans = [(s, t) for s, t, _ in stack] + ([(a, pa)] if pa > a else [])
            pieces.append(Piece(row, pa, pb, _merge_ranges(spans)))
        stack.append((a, b, e))
    return tuple(pieces)


def _merge_ranges(spans: list[tuple[int, int]]) -> Ranges:
    """Adjacent ranges joined (ancestor spans of a depth-first layout often touch)."""
    out: list[list[int]] = []
    for lo, hi in spans:
        if out and out[-1][1] == lo:
            out[-1][1] = hi
        else:
            out.append([lo, hi])
    return tuple((lo, hi) for lo, hi in out)


# ---------------------------------------------------------------------------- kernels

@dataclasses.dataclass(frozen=True, slots=True)
class Kernel:
    """A fused attention kernel pair over ``[1, H, m, D]`` queries and ``[1, Hk, n, D]`` keys.

    ``forward(q, k, v, causal, scale) -> (out [1, H, m, D], lse [1, H, m] float32, aux)``;
    ``backward(g, q, k, v, out, lse, causal, scale, aux) -> (dq, dk, dv)`` with ``out`` /
    ``lse`` the *merged* ones (the split-KV identity) and ``aux`` what the forward call
    returned besides them (the CUDA kernels' sequence / RNG state; None elsewhere)."""

    name: str
    """``cpu_flash`` | ``cuda_flash`` | ``cuda_efficient`` | ``math``."""
    forward: Callable
    """See the class docstring."""
    backward: Callable
    """See the class docstring."""


def _cpu_forward(q, k, v, causal, scale):
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, causal, scale=scale)
    return out, lse, None


def _cpu_backward(g, q, k, v, out, lse, causal, scale, aux):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        g, q, k, v, out, lse, 0.0, causal, scale=scale)


def _expand_heads(q, k, v):
    """Repeat key/value heads to the query heads (GQA) for kernels without native GQA."""
    group = q.shape[1] // k.shape[1]
    if group == 1:
        return k, v, 1
    return k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1), group


def _fold_heads(grad, group):
    """Sum an expanded key/value gradient back over its GQA group."""
    if group == 1:
        return grad
    b, h, n, d = grad.shape
    return grad.view(b, h // group, group, n, d).sum(dim=2)


def _cuda_flash_forward(q, k, v, causal, scale):
    k, v, _ = _expand_heads(q, k, v)
    res = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False,
                                                             scale=scale)
    return res[0], res[1], tuple(res[2:8])      # cum_seq_q/k, max_q/k, philox seed/offset


def _cuda_flash_backward(g, q, k, v, out, lse, causal, scale, aux):
    k2, v2, group = _expand_heads(q, k, v)
    cum_q, cum_k, max_q, max_k, seed, offset = aux
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
        g, q, k2, v2, out, lse.contiguous(), cum_q, cum_k, max_q, max_k, 0.0, causal, seed,
        offset, scale=scale)
    return dq, _fold_heads(dk, group), _fold_heads(dv, group)


def _cuda_efficient_forward(q, k, v, causal, scale):
    k, v, _ = _expand_heads(q, k, v)
    out, lse, seed, offset = torch.ops.aten._scaled_dot_product_efficient_attention(
        q, k, v, None, True, 0.0, causal, scale=scale)
    # the kernel pads lse to a multiple of 32 rows: merge the first m, pad again in backward
    return out, lse[..., :q.shape[2]], (lse.shape[-1], seed, offset)


def _cuda_efficient_backward(g, q, k, v, out, lse, causal, scale, aux):
    k2, v2, group = _expand_heads(q, k, v)
    width, seed, offset = aux
    padded = lse.new_zeros((*lse.shape[:-1], width))
    padded[..., :q.shape[2]] = lse
    dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        g, q, k2, v2, None, out, padded, seed, offset, 0.0, [True, True, True, False], causal,
        scale=scale)
    return dq, _fold_heads(dk, group), _fold_heads(dv, group)


MATH_CHUNK = 1024
"""Query rows per step of the ``math`` kernel (score workspace ``MATH_CHUNK × keys × H``)."""


def _math_scores(q, k, causal, scale, lo):
    s = torch.matmul(q.float() if q.dtype != torch.float64 else q,
                     k.transpose(-1, -2).to(torch.float64 if q.dtype == torch.float64
                                            else torch.float32)) * scale
    if causal:
        rows = torch.arange(lo, lo + q.shape[2], device=q.device).view(-1, 1)
        cols = torch.arange(k.shape[2], device=q.device).view(1, -1)
        s = s.masked_fill(cols > rows, float("-inf"))
    return s


def _math_forward(q, k, v, causal, scale):
    k, v, _ = _expand_heads(q, k, v)
    outs, lses = [], []
    for lo in range(0, q.shape[2], MATH_CHUNK):
        s = _math_scores(q[:, :, lo:lo + MATH_CHUNK], k, causal, scale, lo)
        lse = torch.logsumexp(s, dim=-1)
        outs.append(torch.matmul(torch.exp(s - lse.unsqueeze(-1)), v.to(s.dtype)).to(q.dtype))
        lses.append(lse.float() if q.dtype != torch.float64 else lse)
    return torch.cat(outs, dim=2), torch.cat(lses, dim=2), None


def _math_backward(g, q, k, v, out, lse, causal, scale, aux):
    k2, v2, group = _expand_heads(q, k, v)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k2), torch.zeros_like(v2)
    for lo in range(0, q.shape[2], MATH_CHUNK):
        sl = slice(lo, lo + MATH_CHUNK)
        s = _math_scores(q[:, :, sl], k2, causal, scale, lo)
        p = torch.exp(s - lse[:, :, sl].to(s.dtype).unsqueeze(-1))
        gc = g[:, :, sl].to(s.dtype)
        dv += torch.matmul(p.transpose(-1, -2), gc).to(dv.dtype)
        dp = torch.matmul(gc, v2.to(s.dtype).transpose(-1, -2))
        delta = (gc * out[:, :, sl].to(s.dtype)).sum(-1, keepdim=True)
        ds = p * (dp - delta) * scale
        dq[:, :, sl] = torch.matmul(ds, k2.to(s.dtype)).to(dq.dtype)
        dk += torch.matmul(ds.transpose(-1, -2), q[:, :, sl].to(s.dtype)).to(dk.dtype)
    return dq, _fold_heads(dk, group), _fold_heads(dv, group)


KERNELS = {
    "cpu_flash": Kernel("cpu_flash", _cpu_forward, _cpu_backward),
    "cuda_flash": Kernel("cuda_flash", _cuda_flash_forward, _cuda_flash_backward),
    "cuda_efficient": Kernel("cuda_efficient", _cuda_efficient_forward,
                             _cuda_efficient_backward),
    "math": Kernel("math", _math_forward, _math_backward),
}
"""Kernels by name (:func:`kernel_for` picks one per device and dtype)."""


def kernel_for(device: torch.device, dtype: torch.dtype) -> Kernel:
    """``cpu_flash`` on CPU; on CUDA ``cuda_flash`` for half / bfloat16, ``cuda_efficient`` for
    float32, ``math`` for float64; ``math`` on any other device."""
    if device.type == "cpu":
        return KERNELS["cpu_flash"]
    if device.type == "cuda" and dtype in (torch.float16, torch.bfloat16):
        return KERNELS["cuda_flash"]
    if device.type == "cuda" and dtype == torch.float32:
        return KERNELS["cuda_efficient"]
    return KERNELS["math"]


# ---------------------------------------------------------------------------- driver

def _prefix(t: torch.Tensor, row: int, prefix: Ranges) -> torch.Tensor:
    """The prefix columns of ``t[row]``: a view for one range, else a concatenation."""
    views = [t[row:row + 1, :, lo:hi] for lo, hi in prefix]
    return views[0] if len(views) == 1 else torch.cat(views, dim=2)


def _merge(o1, l1, o2, l2):
    """Attention over two disjoint key sets from each part's output and logsumexp."""
    lse = torch.logaddexp(l1, l2)
    w1, w2 = torch.exp(l1 - lse).unsqueeze(-1), torch.exp(l2 - lse).unsqueeze(-1)
    return (o1 * w1 + o2 * w2).to(o1.dtype), lse


def attend_pieces(query, key, value, pieces, *, kernel: Kernel, scale: float, q_offset: int = 0):
    """Forward over ``pieces``: ``(out like query, lse [R, H, m], aux)``; ``query`` column
    ``c`` holds row column ``c + q_offset``, ``key`` / ``value`` hold row columns from 0;
    ``aux`` (per piece: the kernel's extra state of its two parts) goes to the backward."""
    out = query.new_zeros(query.shape)
    lse = query.new_zeros(query.shape[:3], dtype=torch.promote_types(query.dtype,
                                                                        torch.float32))
    aux = []
    for p in pieces:
        r, a, b = p.row, p.start - q_offset, p.stop - q_offset
        q = query[r:r + 1, :, a:b]
        o, l, own = kernel.forward(q, key[r:r + 1, :, p.start:p.stop],
                                   value[r:r + 1, :, p.start:p.stop], True, scale)
        before = None
        if p.prefix:
            o2, l2, before = kernel.forward(q, _prefix(key, r, p.prefix),
                                            _prefix(value, r, p.prefix), False, scale)
            o, l = _merge(o2, l2, o, l)
        out[r:r + 1, :, a:b] = o
        lse[r:r + 1, :, a:b] = l
        aux.append((own, before))
    return out, lse, aux


def attend_pieces_backward(grad_out, query, key, value, out, lse, pieces, aux, *,
                           kernel: Kernel, scale: float, q_offset: int = 0):
    """Gradients ``(dq like query, dk like key, dv like value)`` of :func:`attend_pieces`."""
    dq, dk, dv = torch.zeros_like(query), torch.zeros_like(key), torch.zeros_like(value)
    grad_out = grad_out.contiguous()
    for p, (own, before) in zip(pieces, aux):
        r, a, b = p.row, p.start - q_offset, p.stop - q_offset
        q, g = query[r:r + 1, :, a:b], grad_out[r:r + 1, :, a:b]
        o, l = out[r:r + 1, :, a:b], lse[r:r + 1, :, a:b]
        gq, gk, gv = kernel.backward(g, q, key[r:r + 1, :, p.start:p.stop],
                                     value[r:r + 1, :, p.start:p.stop], o, l, True, scale, own)
        dq[r:r + 1, :, a:b] += gq
        dk[r:r + 1, :, p.start:p.stop] += gk
        dv[r:r + 1, :, p.start:p.stop] += gv
        if p.prefix:
            gq, gk, gv = kernel.backward(g, q, _prefix(key, r, p.prefix),
                                         _prefix(value, r, p.prefix), o, l, False, scale,
                                         before)
            dq[r:r + 1, :, a:b] += gq
            at = 0
            for lo, hi in p.prefix:
                dk[r:r + 1, :, lo:hi] += gk[:, :, at:at + hi - lo]
                dv[r:r + 1, :, lo:hi] += gv[:, :, at:at + hi - lo]
                at += hi - lo
    return dq, dk, dv


class _SplitKVAttention(torch.autograd.Function):
    """:func:`attend_pieces` with its split-KV backward (no recompute, no masks)."""

    @staticmethod
    def forward(ctx, query, key, value, plan: "SplitKVPlan", scale: float):
        kernel = plan.kernel_for(query)
        out, lse, ctx.aux = attend_pieces(query, key, value, plan.pieces, kernel=kernel,
                                          scale=scale)
        ctx.save_for_backward(query, key, value, out, lse)
        ctx.plan, ctx.scale, ctx.kernel = plan, scale, kernel
        return out

    @staticmethod
    def backward(ctx, grad_out):
        query, key, value, out, lse = ctx.saved_tensors
        dq, dk, dv = attend_pieces_backward(grad_out, query, key, value, out, lse,
                                            ctx.plan.pieces, ctx.aux, kernel=ctx.kernel,
                                            scale=ctx.scale)
        return dq, dk, dv, None, None


@dataclasses.dataclass(frozen=True, slots=True)
class SplitKVPlan:
    """A tree batch's pieces and the kernel to run them with (``tree_plan=`` of an
    ``xlong_tree`` model: its :meth:`attend` is the attention)."""

    pieces: tuple[Piece, ...]
    """Every row's pieces, row by row."""
    kernel: str | None = None
    """A :data:`KERNELS` name, or None for :func:`kernel_for` the query's device and dtype."""

    def kernel_for(self, query: torch.Tensor) -> Kernel:
        """The kernel this plan runs on ``query``."""
        return KERNELS[self.kernel] if self.kernel else kernel_for(query.device, query.dtype)

    def attend(self, query, key, value, *, scale: float) -> torch.Tensor:
        """``[B, H, L, D]`` attention output (zeros on padding queries)."""
        return _SplitKVAttention.apply(query, key, value, self, float(scale))


def split_kv_plan(kv_end: torch.Tensor, valid: torch.Tensor, *,
                  kernel: str | None = None) -> SplitKVPlan:
    """The plan of a tree batch (``kv_end``, ``valid``: ``[R, L]``; one host sync)."""
    if kernel is not None and kernel not in KERNELS:
        raise ValueError(f"split_kv_plan: kernel must be one of {sorted(KERNELS)}, got {kernel!r}")
    ends = kv_end.cpu().numpy()
    lengths = valid.sum(dim=1).cpu().tolist()
    pieces = tuple(p for r, n in enumerate(lengths) for p in tree_pieces(ends[r, :n], row=r))
    return SplitKVPlan(pieces, kernel)
