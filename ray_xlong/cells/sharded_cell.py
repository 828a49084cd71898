"""A sharded cell's Learner as the driver sees it: one handle (:class:`ShardedCell`) over the
ranks of ``sharded.LearnerRank`` that answers the calls ``learner_group.ElasticLearnerGroup``
makes of a single Learner.

```
handle.method.remote(*args)   the call goes to every rank, in order (the ranks' collectives
                              match); the ref back is rank 0's value (state, gradients, weights:
                              rank 0 alone holds them whole) or one that fails as soon as any
                              rank fails (steps, loads: a rank lost mid-step fails the cell's
                              call at once, not after the survivors' collective times out)
take_step_stats               every rank's part merged into the cell's (merge_rank_stats)
rank_joins                    the joins, as Ray tasks in a module that imports no torch
start_sharded_cell            one LearnerRank actor per rank over the cell's bundles, set up
                              into one process group (rank 0 hosts the rendezvous)
```
"""

from __future__ import annotations

import functools
from typing import Any, Sequence

from ray_xlong.cells.learner_settings import LearnerSettings
from ray_xlong.cells.rank_joins import first, merged
from ray_xlong.cells.sharded import BatchOf, LearnerRank
from ray_xlong.cells.sharding import ShardingSettings, rank_placements


@functools.cache
def _task(fn: Any) -> Any:
    """``fn`` as a Ray task (made on first use: this module imports no Ray at import time)."""
    import ray

    return ray.remote(num_cpus=0)(fn)


class _Method:
    """``handle.name.remote(*args)``: call ``name`` on every rank in order; one ref back: rank
    0's (``combine`` None), or ``combine``'s over every rank's refs, as a task."""

    def __init__(self, ranks: Sequence[Any], name: str, combine: Any) -> None:
        self.ranks, self.name, self.combine = ranks, name, combine

    def remote(self, *args: Any) -> Any:
        refs = [getattr(r, self.name).remote(*args) for r in self.ranks]
        return refs[0] if self.combine is None else _task(self.combine).remote(refs)


class _EveryRank:
    """A Learner call of a :class:`ShardedCell` (a descriptor named after the method): it goes
    to every rank; the ref back is rank 0's (``rank0``: state and gradients, which rank 0
    alone holds whole), the ranks' parts merged (``merge``: step statistics), or one that
    fails when any rank failed (steps, loads)."""

    def __init__(self, *, rank0: bool = False, merge: bool = False) -> None:
        self.combine = None if rank0 else merged if merge else first
        self.name = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, cell: ShardedCell | None, owner: type | None = None) -> Any:
        return self if cell is None else _Method(cell.ranks, self.name, self.combine)


class ShardedCell:
    """A cell's Learner ranks behind the one-learner interface: every ``protocols.Learner``
    call (and ``xlong_metrics``, ``__ray_ready__``) goes to every rank (:class:`_EveryRank`)."""

    take_gradients = _EveryRank(rank0=True)
    reduce_step = _EveryRank()
    send_state = _EveryRank()
    get_weights = _EveryRank(rank0=True)
    get_xlong_state = _EveryRank(rank0=True)
    build = _EveryRank()
    accumulate = _EveryRank()
    accumulate_runs = _EveryRank()
    apply_step = _EveryRank()
    send_weights = _EveryRank()
    set_xlong_state = _EveryRank()
    wake_up = _EveryRank()
    sleep = _EveryRank()
    take_step_stats = _EveryRank(merge=True)
    xlong_metrics = _EveryRank()
    save_checkpoint = _EveryRank()
    wait_checkpoint = _EveryRank()
    load_checkpoint = _EveryRank()
    export_hf = _EveryRank()
    __ray_ready__ = _EveryRank()

    def __init__(self, ranks: Sequence[Any]) -> None:
        self.ranks = list(ranks)

    def __len__(self) -> int:
        return len(self.ranks)

    def kill(self) -> None:
        """Stop every rank."""
        import ray

        for r in self.ranks:
            ray.kill(r, no_restart=True)


def kill(actor: Any) -> None:
    """``ray.kill(actor, no_restart=True)``, or every rank of a :class:`ShardedCell`."""
    import ray

    if isinstance(actor, ShardedCell):
        actor.kill()
    else:
        ray.kill(actor, no_restart=True)


def start_sharded_cell(*, pg: Any, settings: LearnerSettings, sharding: ShardingSettings,
                       nodes_per_cell: int, gpus_per_node: int,
                       held_gpu_ids: Sequence[Sequence[str]] = (),
                       cpus_per_rank: float = 0.0,
                       batch_of: BatchOf | None = None) -> ShardedCell:
    """Start ``sharding.ranks_per_cell`` ranks on the bundles of ``pg`` (the same number on
    each, placed by ``sharding.rank_placements``: on CUDA one device per rank, the ranks of a
    bundle whose GPUs the rollout side holds pinned to ``held_gpu_ids`` of that bundle), form
    their process group and shard the model. Returns at once: ``handle.build.remote()``
    resolves when every rank is set up.
    ``batch_of(run_ids, advantages, payloads)`` → module-batch tensors is the Learner connector
    pipeline ``accumulate_runs`` runs (the RLlib adapter hands in
    ``rllib.learner.ConnectorBatches``: this package imports no RLlib).

    Raises:
        ShardingError: the layout cannot host the ranks (``sharding.rank_placements``).
    """
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    world = sharding.ranks_per_cell
    places = rank_placements(sharding, nodes_per_cell=nodes_per_cell,
                             gpus_per_node=gpus_per_node, held_gpu_ids=held_gpu_ids)
    ranks = []
    for p in places:
        env = {} if p.visible_devices is None else {
            "runtime_env": {"env_vars": {"CUDA_VISIBLE_DEVICES": p.visible_devices}}}
        ranks.append(ray.remote(LearnerRank).options(
            num_cpus=cpus_per_rank, num_gpus=p.num_gpus, **env,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                pg, placement_group_bundle_index=p.bundle) if pg is not None else "DEFAULT",
        ).remote(settings=settings, sharding=sharding, rank=p.rank, world_size=world,
                 batch_of=batch_of))
    addr, port = ray.get(ranks[0].address.remote())
    setups = [r.setup.remote(addr, port) for r in ranks]
    cell = ShardedCell(ranks)
    cell.setup_refs = setups
    return cell
