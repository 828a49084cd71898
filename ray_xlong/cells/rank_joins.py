"""The joins a sharded cell's calls run as Ray tasks (``sharded_cell``): one ref back for a call
that went to every rank.

A task's worker imports the module of the function it runs, and a join waits on its ranks, so
a job has several in flight and Ray starts a worker for each; this module imports nothing but
Ray (on first use), so such a worker costs Ray's own start, not torch's and transformers'
(~3 s of CPU each, dozens of workers a job, when the joins lived beside ``LearnerRank``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

if TYPE_CHECKING:
    from ray_xlong.trajectory.loss_stats import LearnerStepStats


def first(refs: list[Any]) -> Any:
    """Rank 0's value once every rank's call succeeded; fails with the first rank that fails,
    as soon as it fails (the refs arrive in a list, so Ray does not wait for all of them)."""
    import ray

    pending = list(refs)
    while pending:
        done, pending = ray.wait(pending, num_returns=1)
        ray.get(done[0])
    return ray.get(refs[0])


def merge_rank_stats(parts: Sequence[LearnerStepStats | None]) -> LearnerStepStats | None:
    """One cell's :class:`LearnerStepStats` from its ranks' parts (None: no rank took part)."""
    out = None
    for part in parts:
        if part is not None:
            out = part if out is None else out.merge_ranks(part)
    return out


def merged(refs: list[Any]) -> LearnerStepStats | None:
    """Every rank's step statistics, merged into the cell's (:func:`merge_rank_stats`)."""
    import ray

    return merge_rank_stats(ray.get(refs))
