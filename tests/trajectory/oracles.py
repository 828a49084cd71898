"""Brute-force oracles for the trajectory processor: prefixes as Python tuples (tiny data only).

A token *at a position* is identified by its whole root path: the tuple of tokens up to and
including it. Two trajectories share a tree node exactly where they share such tuples.
"""

from __future__ import annotations

from ray_xlong.trajectory import AgentRun, Trajectory


def generated_prefixes(run: AgentRun) -> set[tuple[int, ...]]:
    """Every (root path) at which some call of the run generated the last token."""
    out = set()
    for call in run.calls:
        ctx = [int(t) for t in call.input_ids]
        for tok in call.output_ids:
            ctx.append(int(tok))
            out.add(tuple(ctx))
    return out


def prefixes(tokens) -> set[tuple[int, ...]]:
    """All non-empty prefixes of a token sequence."""
    seq = [int(t) for t in tokens]
    return {tuple(seq[:i + 1]) for i in range(len(seq))}


def kept_prefixes(kept: list[Trajectory]) -> set[tuple[int, ...]]:
    """Union of the prefixes of kept trajectories (= the tree's tokens)."""
    out: set[tuple[int, ...]] = set()
    for t in kept:
        out |= prefixes(t.token_ids)
    return out


def row_path(ids_row, mask_row_fn, i: int) -> tuple[int, ...]:
    """Tokens a query at column ``i`` attends to, in column order (its root path in a tree row)."""
    return tuple(int(ids_row[j]) for j in range(i + 1) if mask_row_fn(i, j))
