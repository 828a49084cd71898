"""Packing: runs' kept trajectories → torch tensors for a HF causal LM, in two layouts.

Both layouts share one list of *targets*: every unique trainable token of the batch, once, in the
canonical order (run, owner trajectory, position). A target is predicted by the logits at its
*source* position (the previous token of its root path); per-target metadata (behaviour logprob,
policy version, advantage, loss scale) does not depend on the layout, so a loss computed from
either layout's logprobs is the same number.

``per_trajectory`` — one right-padded row per kept trajectory::

    row 0 (t0)  sys u1 >a1 >a2 t1 >b1  ·  ·  ·      weights 0 0 1 1 0 1
    row 1 (t1)  sys u1  a1  a2 t1  b1 S >s1 >s2     weights 0 0 0 0 0 0 0 1 1   (count-once)
    position    0   1   2   3  4   5  6  7   8
    targets: (row, src=pos-1, token) for every token a row *owns* (weight 1)

``tree`` — each run's tree flattened depth-first into one sequence; several runs share a row up
to ``row_tokens``; attention is ancestor-or-self, positions are depths::

    flat index  0   1   2   3   4   5   6   7   8   9
    token       sys u1 >a1 >a2 t1 >b1 S  >s1 >s2 >x1      (x1: retry branch after a1)
    position    0   1   2   3   4   5   6  7   8   3
    kv_end      10  10  10  9   9   9   9  9   9   10     key j is seen by queries i in
                                                          [j, kv_end[j])
    targets: x1 is predicted at src 2 (a1's flat index), a2 also at src 2: targets are indexed
    per tree *edge*, not per position.

``kv_end`` is the whole mask: ``mask[i, j] = j <= i < kv_end[j]`` (a depth-first layout puts a
node's subtree right after it). Runs in one row have disjoint ranges, so the mask is
block-diagonal across runs. Padding attends only to itself.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Literal, Mapping, Sequence

import numpy as np
import torch

from ray_xlong.trajectory.assembly import Trajectory
from ray_xlong.trajectory.records import AgentRun
from ray_xlong.trajectory.tree import PrefixTree, TreeNode

Layout = Literal["tree", "per_trajectory"]

LAYOUT_CODES: tuple[str, ...] = ("tree", "per_trajectory")
"""``PackedBatch.to_tensors()["layout"]`` holds the index of the layout in this tuple."""

TENSOR_KEYS: tuple[str, ...] = (
    "input_ids", "position_ids", "attention_mask", "valid", "target_row", "target_src",
    "target_ids", "behaviour_logprobs", "policy_versions", "advantages", "loss_scale",
    "target_run",
)
"""The tensor fields of :class:`PackedBatch` (same names in its tensor form), besides
``layout`` and ``run_ids``."""


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class PackedBatch:
    """Tensors for one forward pass, plus the per-target loss inputs. R rows, L columns, T targets."""

    layout: Layout
    """``tree`` | ``per_trajectory``."""
    input_ids: torch.Tensor
    """``[R, L]`` int64 token ids (padding = ``pad_token_id``)."""
    position_ids: torch.Tensor
    """``[R, L]`` int64: index in the trajectory, or depth in the tree."""
    attention_mask: torch.Tensor
    """``per_trajectory``: ``[R, L]`` int64 1/0 padding mask. ``tree``: ``[R, L]`` int64
    ``kv_end`` (see module docstring); expand with :func:`ray_xlong.trajectory.model.tree_mask`."""
    target_row: torch.Tensor
    """``[T]`` int64 row of each target."""
    target_src: torch.Tensor
    """``[T]`` int64 column whose logits predict the target."""
    target_ids: torch.Tensor
    """``[T]`` int64 target token ids (the engine's output ids)."""
    behaviour_logprobs: torch.Tensor
    """``[T]`` float32 logprobs the engine reported when generating each target."""
    policy_versions: torch.Tensor
    """``[T]`` int64 policy version that generated each target."""
    advantages: torch.Tensor
    """``[T]`` float32 advantage of the target's run."""
    loss_scale: torch.Tensor
    """``[T]`` float32: count-once weight ÷ normalizer; ``loss = Σ loss_scale · token_loss``."""
    target_run: torch.Tensor
    """``[T]`` int64 index of the target's run in ``run_ids``."""
    run_ids: tuple[str, ...]
    """The trained runs, in order."""
    valid: torch.Tensor
    """``[R, L]`` bool: True on real tokens, False on padding."""

    @property
    def num_targets(self) -> int:
        """T, the unique trainable tokens of the batch."""
        return int(self.target_ids.numel())

    @property
    def num_positions(self) -> int:
        """Non-padding positions: what a forward pass must compute."""
        return int(self.valid.sum())

    def to_tensors(self) -> dict[str, torch.Tensor]:
        """The batch as a flat dict of tensors (what RLlib module batches, the object store and
        the Learner carry): every tensor field by name (shared, not copied), ``layout`` as a
        ``[1]`` int64 index into :data:`LAYOUT_CODES`, ``run_ids`` as ``[n]`` uint8 UTF-8 JSON."""
        out = {key: getattr(self, key) for key in TENSOR_KEYS}
        out["layout"] = torch.tensor([LAYOUT_CODES.index(self.layout)], dtype=torch.int64)
        encoded = json.dumps(list(self.run_ids)).encode("utf-8")
        out["run_ids"] = torch.tensor(list(encoded), dtype=torch.uint8)
        return out

    @classmethod
    def from_tensors(cls, tensors: Mapping[str, Any]) -> "PackedBatch":
        """Rebuild a batch from :meth:`to_tensors` output (extra keys ignored; tensors taken as
        they are: no copy, any device).

        Raises:
            KeyError: a field is missing (named). TypeError: a field is not a tensor.
            ValueError: the layout code is unknown.
        """
        missing = [k for k in (*TENSOR_KEYS, "layout", "run_ids") if k not in tensors]
        if missing:
            raise KeyError(f"PackedBatch.from_tensors: the batch lacks {missing} (was it "
                           f"written by PackedBatch.to_tensors?)")
        for key in (*TENSOR_KEYS, "layout", "run_ids"):
            if not isinstance(tensors[key], torch.Tensor):
                raise TypeError(f"PackedBatch.from_tensors: {key} must be a torch.Tensor, got "
                                f"{type(tensors[key]).__name__}")
        code = int(tensors["layout"].reshape(-1)[0])
        if not 0 <= code < len(LAYOUT_CODES):
            raise ValueError(f"PackedBatch.from_tensors: layout code {code} is not one of "
                             f"{dict(enumerate(LAYOUT_CODES))}")
        encoded = bytes(tensors["run_ids"].detach().cpu().numpy().astype("uint8"))
        return cls(layout=LAYOUT_CODES[code], run_ids=tuple(json.loads(encoded.decode("utf-8"))),
                   **{key: tensors[key] for key in TENSOR_KEYS})

    def __repr__(self) -> str:
        r, l = self.input_ids.shape
        return (f"PackedBatch(layout={self.layout}, rows={r}, cols={l}, targets={self.num_targets}, "
                f"runs={len(self.run_ids)})")


@dataclasses.dataclass(frozen=True, slots=True)
class RunPiece:
    """What the packer needs of one trained run."""

    run: AgentRun
    """The run (for behaviour logprobs and versions of its calls)."""
    kept: Sequence[Trajectory]
    """Kept trajectories, in kept order (owner index = position)."""
    tree: PrefixTree
    """The run's prefix tree over ``kept``."""
    advantage: float
    """The run's advantage."""


@dataclasses.dataclass(slots=True)
class _Seg:
    owner: int
    depth: int
    node: TreeNode
    lo: int
    hi: int
    call_index: int
    out_start: int


def _segments(piece: RunPiece) -> list[_Seg]:
    """Trainable segments of a run's tree in canonical order (owner, depth)."""
    segs = [_Seg(n.owner, n.depth + g.lo, n, g.lo, g.hi, g.call_index, g.out_start)
            for n in piece.tree.nodes() for g in n.gen]
    segs.sort(key=lambda s: (s.owner, s.depth))
    return segs


def pack(pieces: Sequence[RunPiece], *, layout: Layout, loss_norm: str = "token",
         row_tokens: int | None = 4096, pad_token_id: int = 0,
         normalize: bool = True) -> PackedBatch:
    """Pack trained runs into one batch.

    Args:
        pieces: the trained runs with their kept trajectories and trees.
        layout: ``tree`` or ``per_trajectory``.
        loss_norm: ``token`` (÷ unique trainable tokens of the batch) or ``run`` (each run's mean
            token loss, averaged over runs).
        row_tokens: tree layout: the token budget of a row (a larger run gets a row of its own;
            None = one run per row). Ignored by ``per_trajectory``.
        pad_token_id: id written into padding.
        normalize: divide by the batch's normalizer (default). False: ``loss_scale`` is the
            count-once weight (``token``) or ÷ the run's trainable tokens only (``run``), for
            batches whose normalizer is summed elsewhere (``per_run.normalizer``).

    Returns:
        The packed batch (``T`` = Σ unique trainable tokens; the same targets in both layouts).
    """
    segs = [_segments(p) for p in pieces]
    meta = _target_meta(pieces, segs, loss_norm, normalize)
    if layout == "tree":
        grid, where = _tree_grid(pieces, segs, row_tokens, pad_token_id)
    elif layout == "per_trajectory":
        grid, where = _trajectory_grid(pieces, segs, pad_token_id)
    else:
        raise ValueError(f"pack: layout must be 'tree' or 'per_trajectory', got {layout!r}")
    ids, pos, mask = (torch.from_numpy(a) for a in grid)
    row, src, tgt = (torch.from_numpy(np.concatenate(a) if a else np.zeros(0, np.int64))
                     for a in where)
    return PackedBatch(layout, ids, pos.clamp_min(0), mask, row, src, tgt.long(), *meta,
                       tuple(p.run.run_id for p in pieces), pos >= 0)


def _target_meta(pieces, segs, loss_norm, normalize=True):
    lps, vers, advs, scale, run_idx = [], [], [], [], []
    total = sum(s.hi - s.lo for run_segs in segs for s in run_segs) if normalize else 1
    n_runs = sum(1 for run_segs in segs if run_segs) if normalize else 1
    for r, (piece, run_segs) in enumerate(zip(pieces, segs)):
        n_run = sum(s.hi - s.lo for s in run_segs)
        if loss_norm == "token":
            value = 1.0 / max(total, 1)
        elif loss_norm == "run":
            value = 1.0 / (max(n_run, 1) * max(n_runs, 1))
        else:
            raise ValueError(f"loss_norm must be 'token' or 'run', got {loss_norm!r}")
        for s in run_segs:
            call = piece.run.calls[s.call_index]
            n = s.hi - s.lo
            lps.append(np.asarray(call.output_logprobs[s.out_start:s.out_start + n], np.float32))
            vers.append(np.full(n, call.policy_version, np.int64))
            advs.append(np.full(n, piece.advantage, np.float32))
            scale.append(np.full(n, value, np.float32))
            run_idx.append(np.full(n, r, np.int64))
    cat = (lambda xs, dt: torch.from_numpy(np.concatenate(xs) if xs else np.zeros(0, dt)))
    return (cat(lps, np.float32), cat(vers, np.int64), cat(advs, np.float32),
            cat(scale, np.float32), cat(run_idx, np.int64))


def _flatten_run(tree: PrefixTree):
    """Depth-first flat layout of one tree: tokens, depths, kv_end (run-relative), node starts."""
    nodes = list(tree.nodes())
    if not nodes:
        z = np.zeros(0, np.int64)
        return z, z, z, {}
    lengths = np.array([n.tokens.size for n in nodes], np.int64)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    index = {id(n): i for i, n in enumerate(nodes)}
    subtree = lengths.copy()
    for i in range(len(nodes) - 1, -1, -1):
        parent = nodes[i].parent
        if parent is not None and id(parent) in index:
            subtree[index[id(parent)]] += subtree[i]
    tokens = np.concatenate([n.tokens for n in nodes]).astype(np.int64, copy=False)
    depth = np.concatenate([n.depth + np.arange(n.tokens.size) for n in nodes])
    kv_end = np.repeat(starts + subtree, lengths)
    return tokens, depth, kv_end, {id(n): int(s) for n, s in zip(nodes, starts)}


def _tree_grid(pieces, segs, row_tokens, pad_token_id):
    flats = [_flatten_run(p.tree) for p in pieces]
    rows: list[list[int]] = []
    used = 0
    for r, flat in enumerate(flats):
        size = flat[0].size
        if not rows or row_tokens is None or used + size > row_tokens:
            rows.append([])
            used = 0
        rows[-1].append(r)
        used += size
    width = max([sum(flats[r][0].size for r in row) for row in rows] + [1])
    ids = np.full((len(rows), width), pad_token_id, np.int64)
    pos = np.full((len(rows), width), -1, np.int64)
    end = np.tile(np.arange(1, width + 1, dtype=np.int64), (len(rows), 1))
    where_row, where_src, where_tgt = [], [], []
    for i, row in enumerate(rows):
        off = 0
        for r in row:
            tokens, depth, kv_end, starts = flats[r]
            n = tokens.size
            ids[i, off:off + n], pos[i, off:off + n], end[i, off:off + n] = tokens, depth, kv_end + off
            for s in segs[r]:
                src = off + starts[id(s.node)] + np.arange(s.lo, s.hi) - 1
                if s.lo == 0:
                    parent = s.node.parent
                    src[0] = off + starts[id(parent)] + parent.tokens.size - 1
                where_row.append(np.full(s.hi - s.lo, i, np.int64))
                where_src.append(src)
                where_tgt.append(np.asarray(s.node.tokens[s.lo:s.hi], np.int64))
            off += n
    return (ids, pos, end), (where_row, where_src, where_tgt)


def _trajectory_grid(pieces, segs, pad_token_id):
    trajs = [t for p in pieces for t in p.kept]
    width = max([t.num_tokens for t in trajs] + [1])
    ids = np.full((len(trajs), width), pad_token_id, np.int64)
    pos = np.full((len(trajs), width), -1, np.int64)
    mask = np.zeros((len(trajs), width), np.int64)
    for i, t in enumerate(trajs):
        ids[i, :t.num_tokens] = t.token_ids
        pos[i, :t.num_tokens] = np.arange(t.num_tokens)
        mask[i, :t.num_tokens] = 1
    first_row = np.cumsum([0] + [len(p.kept) for p in pieces])
    where_row, where_src, where_tgt = [], [], []
    for r, run_segs in enumerate(segs):
        for s in run_segs:
            row = first_row[r] + s.owner
            cols = np.arange(s.depth, s.depth + s.hi - s.lo)
            where_row.append(np.full(cols.size, row, np.int64))
            where_src.append(cols - 1)
            where_tgt.append(ids[row, cols])
    return (ids, pos, mask), (where_row, where_src, where_tgt)


def micro_batches(batch: PackedBatch, *, max_tokens: int) -> list[PackedBatch]:
    """Split a batch by rows into micro-batches of at most ``max_tokens`` (rows × width).

    Rows are taken in order; each micro-batch is trimmed to its longest row, and a row wider than
    ``max_tokens`` goes alone. ``loss_scale`` keeps the whole batch's normalizer, so the sum of
    the micro-batches' losses is the batch's loss (gradient accumulation needs no rescaling).

    Args:
        batch: a packed batch, either layout.
        max_tokens: token budget of a micro-batch (>= 1).

    Returns:
        Micro-batches covering every row and every target exactly once, in order.
    """
    if max_tokens < 1:
        raise ValueError(f"micro_batches: max_tokens must be >= 1, got {max_tokens}")
    lengths = batch.valid.sum(dim=1).tolist()
    groups: list[list[int]] = []
    width = 0
    for r, n in enumerate(lengths):
        if groups and max(width, n) * (len(groups[-1]) + 1) <= max_tokens:
            groups[-1].append(r)
            width = max(width, n)
        else:
            groups.append([r])
            width = n
    return [_take_rows(batch, rows) for rows in groups]


def _take_rows(batch: PackedBatch, rows: list[int]) -> PackedBatch:
    index = torch.tensor(rows, dtype=torch.int64)
    width = max(int(batch.valid[index].sum(dim=1).max()), 1)
    remap = torch.full((batch.input_ids.shape[0],), -1, dtype=torch.int64)
    remap[index] = torch.arange(len(rows))
    keep = remap[batch.target_row] >= 0
    cut = (lambda t: t[index, :width])
    return PackedBatch(batch.layout, cut(batch.input_ids), cut(batch.position_ids),
                       cut(batch.attention_mask), remap[batch.target_row[keep]],
                       batch.target_src[keep], batch.target_ids[keep],
                       batch.behaviour_logprobs[keep], batch.policy_versions[keep],
                       batch.advantages[keep], batch.loss_scale[keep], batch.target_run[keep],
                       batch.run_ids, cut(batch.valid))
