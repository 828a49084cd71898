"""Context parallelism inside a sharded training cell: which rank trains which tokens.

A cell of ``N`` Learner ranks with ``LearnerSettings.context_parallel = cp`` runs ``N ÷ cp``
data-parallel groups of ``cp`` consecutive ranks, composed with FSDP2 over all ``N``::

    N = 4, cp = 2        ranks 0 1 | 2 3            FSDP2: one mesh of all 4 ranks (gradients
    data-parallel group      0  |  1                reduce-scatter as sums over all of them)
    rows of a micro-batch   r ≡ g (mod N ÷ cp) ─► joined into one row (join_rows)
    inside a group          rank g·cp + i holds columns [i·W, (i+1)·W) of that row
                            (trajectory/context_parallel.py: the ancestor spans of K/V other
                            ranks need exchanged per layer inside the group, all-gathered or
                            passed round a ring, partial attention merged by logsumexp)

Every rank runs exactly one forward and one backward per micro-batch (FSDP's and the
group's collectives match); a group without rows trains row 0 with zero loss scale. Each rank's
loss covers the targets predicted from its own columns, so the cell's summed gradient equals
one device's. A rank lost inside a step fails the cell's call like any sharded cell's
(``sharded.py``: the step's share is redone by the elastic group).
"""

from __future__ import annotations

from typing import Any

import torch

from ray_xlong.trajectory.context_parallel import (ContextParallelPlan, check_context_parallel,
                                                   context_groups, join_rows, shard_row)
from ray_xlong.trajectory.packing import PackedBatch


def rank_share(batch: PackedBatch, *, rank: int, world_size: int, context_parallel: int,
               group: Any = None,
               exchange: str = "ring") -> tuple[PackedBatch, ContextParallelPlan, int]:
    """Rank ``rank``'s share of a tree micro-batch.

    Args:
        batch: the micro-batch (tree layout; any number of rows).
        rank: the rank in the cell (0 … ``world_size`` − 1).
        world_size: the cell's Learner ranks.
        context_parallel: ranks per row (divides ``world_size``).
        group: this rank's context-parallel process group (:func:`make_groups`).
        exchange: ``ring`` (the ancestor spans other ranks need, one rank's block at a time
            round the group; the default), ``spans`` (the same spans all-gathered) or ``all``
            (whole ranges; ``trajectory.context_parallel.EXCHANGES``).

    Returns:
        ``(local batch, plan, targets)``: pass the plan as ``token_logprobs(plan=...)``;
        ``targets`` counts the targets this rank trains (0 when its group got no row).
    """
    check_context_parallel(context_parallel, world_size)
    groups = world_size // context_parallel
    rows = list(range(rank // context_parallel, int(batch.input_ids.shape[0]), groups))
    joined = join_rows(batch, rows or [0])
    if not rows:
        joined = PackedBatch.from_tensors({**joined.to_tensors(),
                                           "loss_scale": torch.zeros_like(joined.loss_scale)})
    local, plan = shard_row(joined, rank=rank % context_parallel, size=context_parallel,
                            group=group, exchange=exchange)
    return local, plan, local.num_targets if rows else 0


def make_groups(world_size: int, context_parallel: int, rank: int) -> Any:
    """This rank's context-parallel process group (collective: every rank calls it)."""
    return context_groups(world_size, context_parallel)[rank // context_parallel]
