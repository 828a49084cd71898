"""Selection: keep at most K trajectories per run, ranked main agent > its summaries > subagents.

Order (deterministic, total):

1. ``rank``: 0 main agent, 1 summaries of a main agent, 2 subagents and their summaries;
2. more model-generated tokens first (more training signal for the same slot);
3. creation order (``Trajectory.index``), the order of each trajectory's first call.

The first K in this order are kept, in this order; the rest are dropped (and counted). Dropped
trajectories still mark generated tokens they share with kept ones (see ``tree.py``).
"""

from __future__ import annotations

from ray_xlong.trajectory.assembly import Trajectory


def selection_key(t: Trajectory) -> tuple[int, int, int]:
    """Sort key of the ranking above."""
    return (t.rank, -t.num_generated, t.index)


def select(trajectories: list[Trajectory], k: int) -> tuple[list[Trajectory], list[Trajectory]]:
    """Split a run's trajectories into (kept, dropped).

    Args:
        trajectories: one run's trajectories (any order).
        k: the cap, ``>= 1``.

    Returns:
        ``(kept, dropped)``, each in ranking order; ``len(kept) == min(k, len(trajectories))``.
    """
    if k < 1:
        raise ValueError(f"max_trajectories_per_run must be >= 1, got {k}")
    ranked = sorted(trajectories, key=selection_key)
    return ranked[:k], ranked[k:]
