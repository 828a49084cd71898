"""Tree attention: exact ancestor-or-self attention that skips what the mask would hide.

A dense tree mask makes every row cost ``L²`` (a run's whole tree), which can exceed the
per-trajectory cost ``Σ Lᵢ²/2`` and eat the dedup gain. This attention computes only the pairs
the tree allows, on any device, with fused scaled-dot-product attention kernels.

The rule ``mask[i, j] = j <= i < kv_end[j]`` splits a row into *segments*: maximal runs of
consecutive tokens with equal ``kv_end`` (a node, merged with its last-child chain). For a
segment ``[a, b)``, every earlier key is either an ancestor of the whole segment
(``kv_end[j] > a``) or of none of it (``kv_end[j] <= a``), so a segment attends to::

    keys = ancestors(a) ++ [a, b)        mask = [ all ancestors | causal within the segment ]

    flat   0   1   2   3   4   5   6   7   8   9
    token  sys u1 >a1 >a2 t1 >b1  S >s1 >s2 >x1
    kv_end 10  10  10   9   9   9   9   9   9  10
    segments: [0,3) keys {} + 0..2 · [3,9) keys 0..2 + 3..8 · [9,10) keys 0..2 + 9

On CPU (no dropout) each segment is two fused flash-attention calls, and nothing is masked::

    prefix part  q[a:b] × keys ancestors(a)   full       (a view when they are one range)
    self part    q[a:b] × keys [a, b)          is_causal  (square, so top-left causal is exact)
    merged       out = Σ_part o_part · exp(lse_part − lse),   lse = logaddexp(lse_prefix, lse_self)

The backward runs the kernel's backward on each part with the *merged* output and logsumexp
(the split-KV identity: a part's probabilities are ``exp(s − lse)``), adding into one gradient
buffer per tensor: no recompute, no additive masks, no per-segment full-size zero gradients.
Work = Σ over tree tokens of their depth, ≤ the per-trajectory work Σ Lᵢ²/2 (every tree token
sits at the same depth in some trajectory). Other devices run the same split-KV merge over their
fused kernels (``split_kv.py``: CUDA flash / memory-efficient, no masks). With attention dropout
each segment is one plain ``scaled_dot_product_attention`` call over its keys with a cached mask;
``chunk`` cuts long segments there so the masked-out triangle stays ≤ ``chunk²/2`` per piece.
Sliding windows (Mistral, Qwen2, Gemma-2/3, Cohere-2, Starcoder2: the layer's ``sliding_window``)
count along the trajectory: query ``q`` sees key ``k`` of its path iff ``depth(q) - depth(k) <
window``, ``depth`` being the positions the plan was built with. A windowed layer cuts each
segment into pieces of ``window`` queries; a piece's keys are the suffix of its path that any of
its queries can see (≤ 2·window keys), under a small bool mask, so the work is O(L · window), not
O(L · depth). Attention-logit soft-capping (Gemma-2's ``softcap``) runs the same pieces with
explicit scores (``tanh(s / cap) · cap``, masked softmax in float32), exact like HF's eager path.
Registered with transformers as ``attn_implementation="xlong_tree"``; without a plan (e.g. the
per-trajectory layout or generation) it falls back to HF's sdpa path, so one model serves both.
Padding queries (after a row's last real token) get zeros.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
import torch.nn.functional as F

ATTN_IMPLEMENTATION = "xlong_tree"
_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_FLASH_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


class TreeLayoutUnsupported(ValueError):
    """The tree layout cannot be exact for the model's attention variant (message: the variant
    and the way out)."""


@dataclasses.dataclass(frozen=True, slots=True)
class TreeSegment:
    """Queries ``[start, stop)`` of ``row`` attend to ``keys`` (ancestors, then themselves)."""

    row: int
    """Row of the packed batch."""
    start: int
    """First query column."""
    stop: int
    """One past the last query column."""
    keys: torch.Tensor
    """``[n_prefix + stop − start]`` int64 key columns: all visible keys before ``start``
    (ancestors, then the segment's earlier chunks), ascending, then ``start..stop-1``."""
    prefix_start: int | None = None
    """First prefix column when the prefix keys are one contiguous range (a view, no gather);
    ``None`` when they are not (or there are none)."""

    @property
    def num_prefix(self) -> int:
        """Keys before ``start`` (seen in full)."""
        return int(self.keys.numel()) - (self.stop - self.start)


@dataclasses.dataclass(frozen=True, slots=True)
class TreePlan:
    """The segments of every row (see module docstring)."""

    rows: tuple[tuple[TreeSegment, ...], ...]
    """Each row's segments, left to right (covering its real tokens once)."""
    valid_lengths: tuple[int, ...]
    """Real tokens per row (padding follows)."""
    masks: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)
    """Cache of additive masks by (segment, dtype) and of windowed pieces by window: built
    once, reused by every layer."""
    depth: torch.Tensor | None = dataclasses.field(default=None, compare=False, repr=False)
    """``[R, L]`` positions (depth along the trajectory) for sliding windows; None: the index
    along the path."""

    def pieces(self, window: int | None) -> tuple["TreePiece", ...]:
        """The plan cut for a layer with ``window`` (None: one piece per segment, for
        soft-capping without a window); cached by window."""
        key = ("pieces", window)
        if key not in self.masks:
            self.masks[key] = tuple(p for seg in self.segments
                                    for p in _segment_pieces(seg, window, self.depth))
        return self.masks[key]

    def mask(self, seg: TreeSegment, dtype: torch.dtype) -> torch.Tensor:
        """``[m, n_prefix + m]`` additive mask: 0 on the prefix, causal on the segment."""
        key = (seg.row, seg.start, dtype)
        if key not in self.masks:
            m, n_prefix = seg.stop - seg.start, seg.num_prefix
            mask = torch.zeros(m, n_prefix + m, dtype=dtype, device=seg.keys.device)
            own = torch.ones(m, m, dtype=torch.bool, device=seg.keys.device).triu(1)
            mask[:, n_prefix:].masked_fill_(own, float("-inf"))
            self.masks[key] = mask
        return self.masks[key]

    @property
    def segments(self) -> tuple[TreeSegment, ...]:
        """Every row's segments, row by row."""
        return tuple(seg for row in self.rows for seg in row)

    @property
    def work(self) -> int:
        """Query-key pairs computed: Σ (stop − start) · |keys|."""
        return sum((s.stop - s.start) * int(s.keys.numel()) for row in self.rows for s in row)


@dataclasses.dataclass(frozen=True, slots=True)
class TreePiece:
    """Queries ``[start, stop)`` of ``row`` over ``keys`` under ``allowed`` (windowed or
    soft-capped layers)."""

    row: int
    """Row of the packed batch."""
    start: int
    """First query column."""
    stop: int
    """One past the last query column."""
    keys: torch.Tensor
    """``[n]`` int64 key columns: the suffix of the queries' path any of them may see."""
    allowed: torch.Tensor
    """``[stop − start, n]`` bool: on the path at or before the query, inside the window."""


def _segment_pieces(seg: TreeSegment, window: int | None, depth: torch.Tensor | None
                    ) -> list[TreePiece]:
    """A segment cut into pieces of ``window`` queries, each with the keys it can see."""
    device = seg.keys.device
    step = window or (seg.stop - seg.start)
    pieces = []
    for lo in range(seg.start, seg.stop, step):
        hi = min(seg.stop, lo + step)
        path = seg.keys[:seg.num_prefix + hi - seg.start]
        cols = torch.arange(lo, hi, device=device)
        if depth is None:                                   # depth = index along the path
            d_path = torch.arange(path.numel(), device=device)
            d_q = d_path[seg.num_prefix + lo - seg.start:]
        else:
            d_path, d_q = depth[seg.row, path], depth[seg.row, lo:hi]
        if window is not None:
            keep = d_path > d_q[0] - window
            path, d_path = path[keep], d_path[keep]
        allowed = path.unsqueeze(0) <= cols.unsqueeze(1)
        if window is not None:
            allowed &= (d_q.unsqueeze(1) - d_path.unsqueeze(0)) < window
        pieces.append(TreePiece(seg.row, lo, hi, path, allowed))
    return pieces


def tree_plan(kv_end: torch.Tensor, valid: torch.Tensor, *,
              chunk: int | None = None, depth: torch.Tensor | None = None) -> TreePlan:
    """Segments of a tree batch.

    Args:
        kv_end: ``[R, L]`` int64 (``PackedBatch.attention_mask`` of the tree layout).
        valid: ``[R, L]`` bool, real tokens (a prefix of each row).
        chunk: most queries per segment piece (>= 1); ``None``: uncut on CPU (the fused
            path computes no masked-out pairs, so cutting only adds calls), 256 elsewhere.
        depth: ``[R, L]`` positions (the tree layout's ``position_ids``) for sliding windows.

    Returns:
        The plan; its key tensors live on ``kv_end``'s device.
    """
    if chunk is None:
        chunk = 0 if kv_end.device.type == "cpu" else 256
    rows = []
    lengths = valid.sum(dim=1).tolist()
    ends = kv_end.cpu().numpy()
    for row, n in enumerate(lengths):
        kv = ends[row, :n]
        starts = np.concatenate([[0], np.flatnonzero(kv[1:] != kv[:-1]) + 1]).astype(np.int64)
        stops = np.append(starts[1:], n)
        segments = []
        for a, b in zip(starts.tolist(), stops.tolist()) if n else ():
            ancestors = np.flatnonzero(kv[:a] > a)
            step = chunk or max(b - a, 1)
            for lo in range(a, b, step):
                hi = min(b, lo + step)
                prefix = np.concatenate([ancestors, np.arange(a, lo)]).astype(np.int64)
                contiguous = prefix.size and prefix[-1] - prefix[0] + 1 == prefix.size
                keys = np.concatenate([prefix, np.arange(lo, hi)])
                segments.append(TreeSegment(row, lo, hi,
                                            torch.from_numpy(keys).to(kv_end.device),
                                            int(prefix[0]) if contiguous else None))
        rows.append(tuple(segments))
    return TreePlan(tuple(rows), tuple(int(n) for n in lengths),
                    depth=None if depth is None else depth.to(kv_end.device))


def _prefix_kv(key, value, seg: TreeSegment):
    """The segment's prefix keys and values: a view when they form one range, else a gather."""
    if seg.prefix_start is not None:
        first, stop = seg.prefix_start, seg.prefix_start + seg.num_prefix
        return key[seg.row:seg.row + 1, :, first:stop], value[seg.row:seg.row + 1, :, first:stop]
    cols = seg.keys[:seg.num_prefix]
    return (key[seg.row:seg.row + 1].index_select(2, cols),
            value[seg.row:seg.row + 1].index_select(2, cols))


def _merge(o1, l1, o2, l2):
    """Attention over two disjoint key sets from each part's output and logsumexp."""
    lse = torch.logaddexp(l1, l2)
    w1, w2 = torch.exp(l1 - lse).unsqueeze(-1), torch.exp(l2 - lse).unsqueeze(-1)
    return (o1 * w1 + o2 * w2).to(o1.dtype), lse          # low precision: merged in float32


class _TreeAttention(torch.autograd.Function):
    """Segments' attention with the fused CPU kernels, split into prefix and causal self.

    Backward runs the kernel's backward on each part with the *merged* output and logsumexp
    (the split-KV identity: each part's probabilities are ``exp(s − lse)``), writing into one
    gradient buffer per tensor — no recompute, no per-segment full-size zero gradients.
    """

    @staticmethod
    def forward(ctx, query, key, value, plan: TreePlan, scale: float):
        out = query.new_zeros(query.shape)
        lse = query.new_zeros(query.shape[:3], dtype=torch.promote_types(query.dtype,
                                                                            torch.float32))
        for seg in plan.segments:
            r, a, b = seg.row, seg.start, seg.stop
            q = query[r:r + 1, :, a:b]
            o, l = _FLASH(q, key[r:r + 1, :, a:b], value[r:r + 1, :, a:b], 0.0, True,
                          scale=scale)
            if seg.num_prefix:
                k, v = _prefix_kv(key, value, seg)
                o, l = _merge(*_FLASH(q, k, v, 0.0, False, scale=scale), o, l)
            out[r:r + 1, :, a:b] = o
            lse[r:r + 1, :, a:b] = l
        ctx.save_for_backward(query, key, value, out, lse)
        ctx.plan, ctx.scale = plan, scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        query, key, value, out, lse = ctx.saved_tensors
        plan, scale = ctx.plan, ctx.scale
        dq, dk, dv = torch.zeros_like(query), torch.zeros_like(key), torch.zeros_like(value)
        grad_out = grad_out.contiguous()
        for seg in plan.segments:
            r, a, b = seg.row, seg.start, seg.stop
            q, g = query[r:r + 1, :, a:b], grad_out[r:r + 1, :, a:b]
            o, l = out[r:r + 1, :, a:b], lse[r:r + 1, :, a:b]
            gq, gk, gv = _FLASH_BACKWARD(g, q, key[r:r + 1, :, a:b], value[r:r + 1, :, a:b],
                                         o, l, 0.0, True, scale=scale)
            dq[r:r + 1, :, a:b] += gq
            dk[r:r + 1, :, a:b] += gk
            dv[r:r + 1, :, a:b] += gv
            if seg.num_prefix:
                k, v = _prefix_kv(key, value, seg)
                gq, gk, gv = _FLASH_BACKWARD(g, q, k, v, o, l, 0.0, False, scale=scale)
                dq[r:r + 1, :, a:b] += gq
                if seg.prefix_start is not None:
                    first, stop = seg.prefix_start, seg.prefix_start + seg.num_prefix
                    dk[r:r + 1, :, first:stop] += gk
                    dv[r:r + 1, :, first:stop] += gv
                else:
                    cols = seg.keys[:seg.num_prefix]
                    dk[r:r + 1].index_add_(2, cols, gk)
                    dv[r:r + 1].index_add_(2, cols, gv)
        return dq, dk, dv, None, None


def _segment_kv(key, value, seg: TreeSegment):
    """The segment's keys and values: a slice when they form one range, else a gather."""
    first, n_keys = int(seg.keys[0]), int(seg.keys.numel())
    if int(seg.keys[-1]) - first + 1 == n_keys:
        return (key[seg.row:seg.row + 1, :, first:first + n_keys],
                value[seg.row:seg.row + 1, :, first:first + n_keys])
    return (key[seg.row:seg.row + 1].index_select(2, seg.keys),
            value[seg.row:seg.row + 1].index_select(2, seg.keys))


def _segment_attention(q, k, v, seg: TreeSegment, plan: TreePlan, scaling, dropout,
                       gqa: bool):
    """SDPA of one segment's queries ``q`` over its keys: prefix in full, itself causally."""
    if seg.num_prefix == 0:                               # plain causal: no mask at all
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True,
                                              scale=scaling, enable_gqa=gqa)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=plan.mask(seg, q.dtype),
                                          dropout_p=dropout, scale=scaling, enable_gqa=gqa)


def tree_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                           value: torch.Tensor, attention_mask, dropout: float = 0.0,
                           scaling: float | None = None, tree_plan=None,
                           **kwargs):
    """HF attention-interface function (``query [B, H, L, D]``, ``key/value [B, Hkv, L, D]``).

    ``tree_plan``: a :class:`TreePlan` (CPU kernels; masked sdpa where dropout is on), or any
    plan with an ``attend(query, key, value, *, scale)`` method (``split_kv.SplitKVPlan``: the
    fused-kernel path of every device; ``context_parallel.ContextParallelPlan``).

    Returns ``(output [B, L, H, D], None)`` like HF's implementations. Padding queries get zeros.
    """
    if tree_plan is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        if isinstance(attention_mask, torch.Tensor) and not attention_mask.is_floating_point() \
                and attention_mask.dtype != torch.bool:
            raise TreeLayoutUnsupported(
                f"{type(module).__name__}: this architecture's attention does not pass the tree "
                f"plan through to attn_implementation='xlong_tree'; use 'sdpa' / 'eager' or "
                f"pack='per_trajectory'")
        return sdpa_attention_forward(module, query, key, value, attention_mask,
                                      dropout=dropout, scaling=scaling, **kwargs)
    if hasattr(tree_plan, "attend"):     # split-KV plans: split_kv.py, context_parallel.py
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        return tree_plan.attend(query, key, value, scale=scale).transpose(1, 2).contiguous(), None
    dropout = dropout if module.training else 0.0
    window, softcap = kwargs.get("sliding_window"), kwargs.get("softcap")
    if window is not None or softcap:
        return _pieces_forward(query, key, value, tree_plan, window, softcap, scaling, dropout)
    if query.device.type == "cpu" and dropout == 0.0:
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        out = _TreeAttention.apply(query, key, value, tree_plan, float(scale))
        return out.transpose(1, 2).contiguous(), None
    gqa = key.shape[1] != query.shape[1]
    rows = []
    for segments, n in zip(tree_plan.rows, tree_plan.valid_lengths):
        parts = []
        for seg in segments:
            k, v = _segment_kv(key, value, seg)
            q = query[seg.row:seg.row + 1, :, seg.start:seg.stop]
            parts.append(_segment_attention(q, k, v, seg, tree_plan, scaling, dropout, gqa))
        pad = query.new_zeros(1, query.shape[1], query.shape[2] - n, value.shape[-1])
        rows.append(torch.cat(parts + [pad], dim=2))
    return torch.cat(rows, dim=0).transpose(1, 2).contiguous(), None


def _pieces_forward(query, key, value, plan: TreePlan, window: int | None,
                    softcap: float | None, scaling: float | None, dropout: float):
    """Attention of a windowed or soft-capped layer, piece by piece (module docstring)."""
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    groups = query.shape[1] // key.shape[1]
    out = query.new_zeros(query.shape[:3] + (value.shape[-1],))
    for piece in plan.pieces(int(window) if window is not None else None):
        r = piece.row
        q = query[r:r + 1, :, piece.start:piece.stop]
        k = key[r:r + 1].index_select(2, piece.keys)
        v = value[r:r + 1].index_select(2, piece.keys)
        if not softcap:
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=piece.allowed,
                                               dropout_p=dropout, scale=scale,
                                               enable_gqa=groups > 1)
        else:
            k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
            scores = torch.tanh(q @ k.transpose(-1, -2) * scale / softcap) * softcap
            scores = scores.masked_fill(~piece.allowed, float("-inf"))
            probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
            o = F.dropout(probs, p=dropout, training=dropout > 0) @ v
        out[r:r + 1, :, piece.start:piece.stop] = o
    return out.transpose(1, 2).contiguous(), None


def register() -> str:
    """Register ``xlong_tree`` with transformers (idempotent); returns the name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTN_IMPLEMENTATION, tree_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)
    return ATTN_IMPLEMENTATION
