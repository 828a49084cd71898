"""Cells as Ray placement groups: created once, each hosting an engine runner and a Learner.

```
cell c = placement group, strategy STRICT_SPREAD (one bundle per node) or PACK
  bundle 0 {CPU: cpus_per_bundle, GPU: gpus_per_node [, learner_resource: 1]}  ◄─ runner
  bundle 1 … nodes_per_cell-1 (the cell's other nodes)                  learner (its GPUs)
  with engine actors (CellActors.engine_actors): the runner starts one actor per engine on
  the cell's bundles (cells/engine_actors.py); they hold the GPUs, the runner none
```

Which classes the runner and the learner are is not this module's business: a
:class:`CellActors` names them (the RLlib adapter's ``CellRunner`` / ``XLongLearner``, see
``ray_xlong.rllib.cell_actors``), so the runtime needs no RLlib.

Both actors of a cell share bundle 0 (half its CPUs each). The Learner holds the bundle's
GPUs in Ray's accounting (``ray.get_gpu_ids()`` inside it names them; a ``ShardedCell``'s ranks
hold their bundles' GPUs, ``sharding.rank_placements``) and the runner, which time-shares them
(its engines sleep while the cell trains), asks Ray for none and is pinned to them by
``CUDA_VISIBLE_DEVICES`` (:func:`learner_holds_gpus`). With engine actors those hold the GPUs
instead and the ranks are pinned to them. The request is real on logical GPUs too: the torch
device is ``ShardingSettings.device`` (an unsharded Learner, RLlib's, computes on CPU), so a
CPU Learner holding logical GPUs never tries NCCL. With ``ShardingSettings.device='cuda'`` the
learner is a ``ShardedCell`` (NCCL, one CUDA device a rank); :func:`create_cells` first probes
bundle 0 of every cell (every bundle, with engine actors) with a task holding its GPUs: no CUDA
device there (logical GPUs) is a ``ShardingError`` naming the field before any actor starts;
with engine actors the ids found are the GPUs the ranks are pinned to. A role
switch sleeps one actor and wakes the other; placement groups are never created after
:func:`create_cells` (``CellPool.placement_groups_created`` counts them).

The layout and its pure check are ``cells/layout.py``.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Mapping

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from ray_xlong.cells.layout import CellLayout, LayoutError, check_layout
from ray_xlong.cells.ray_edge import actor_lost
from ray_xlong.cells.sharded import BatchOf
from ray_xlong.cells.sharded_cell import ShardedCell, kill, start_sharded_cell
from ray_xlong.cells.sharding import ShardingError, ShardingSettings, ranks_per_bundle

if TYPE_CHECKING:  # annotations only
    from ray.actor import ActorHandle
    from ray.util.placement_group import PlacementGroup

    from ray_xlong.cells.learner_settings import LearnerSettings
    from ray_xlong.cells.engines import EngineLayout
    from ray_xlong.cells.protocols import Learner, Runner


@dataclasses.dataclass(frozen=True, slots=True)
class CellActors:
    """The two actor classes a cell hosts and their constructor arguments. The cell runtime
    does not know them: the RLlib adapter hands them in (``ray_xlong.rllib.cell_actors``).

    The runner class keeps the :class:`~ray_xlong.cells.protocols.Runner` contract (role calls
    with trailing ``after`` refs, ``wait_ended`` in a ``poll`` concurrency group), the learner
    class the :class:`~ray_xlong.cells.protocols.Learner` contract (the elastic step's calls).
    """

    runner_class: type[Runner]
    """Built as ``runner_class(cell=index, **runner_kwargs)`` (half the bundle's CPUs; no Ray
    GPU: pinned to the ones its Learner holds)."""
    runner_kwargs: Mapping[str, Any]
    """Constructor arguments of every cell's runner."""
    learner_class: type[Learner]
    """Built as ``learner_class(**learner_kwargs)``, then ``build()``."""
    learner_kwargs: Mapping[str, Any]
    """Constructor arguments of every cell's learner."""
    learner_settings: LearnerSettings | None = None
    """What a sharded learner trains (with ``sharding``)."""
    sharding: ShardingSettings | None = None
    """With ``ranks_per_cell`` > 1 or ``device='cuda'`` a cell's learner is a
    ``sharded_cell.ShardedCell`` of ranks over its bundles instead of ``learner_class``."""
    batch_of: BatchOf | None = None
    """A sharded learner's Learner connector pipeline (the same pieces ``learner_class``
    runs)."""
    engines: EngineLayout | None = None
    """The runner's ``engines.EngineLayout`` (placement resolved) when its engine factory is a
    ``CellEngines``: checked against the layout before anything starts. None: one engine, or a
    factory of the user's own (in the runner's process)."""

    @property
    def engine_actors(self) -> bool:
        """Whether the runner hosts its engines as actors of their own (``EngineLayout.placement
        ='actors'``): the runner then asks Ray for no GPU (its engine actors take the cell's
        GPUs) and CUDA Learner ranks are pinned to every bundle's GPUs."""
        return self.engines is not None and self.engines.placement == "actors"

    @property
    def sharded(self) -> bool:
        """Whether a cell's learner is a ``ShardedCell``."""
        return self.sharding is not None and (self.sharding.ranks_per_cell > 1
                                              or self.sharding.device == "cuda")


@dataclasses.dataclass(slots=True)
class Cell:
    """One cell: its placement group and the two actors sharing bundle 0."""

    index: int
    """Cell index."""
    pg: PlacementGroup
    """The placement group (kept for the whole job)."""
    runner: ActorHandle
    """The runner actor (``CellActors.runner_class``: a ``protocols.Runner``)."""
    learner: ActorHandle | ShardedCell
    """The learner actor (``CellActors.learner_class``, built: a ``protocols.Learner``), or the
    ranks of a sharded one."""


@dataclasses.dataclass(slots=True)
class CellPool:
    """All cells, created once."""

    layout: CellLayout
    """Their layout."""
    cells: list[Cell]
    """By index."""
    placement_groups_created: int
    """Placement groups this pool created (== cells: role switches create none)."""
    startup_s: float
    """Seconds to create the groups and start every actor."""
    initial_state: Any = None
    """Object ref of the learners' version-0 state (to reset between jobs)."""
    initial_weights: Any = None
    """Object ref of the version-0 weights (engines are reset to them)."""
    spawn: Any = None
    """``spawn(index, pg, which) -> actor``: starts a cell's runner or learner again."""
    actors_replaced: int = 0
    """Actors started again after a loss (runner or learner)."""

    def replace(self, cell: int, which: str, *, timeout_s: float = 120.0) -> Any:
        """Start ``cell``'s ``which`` ("runner" | "learner") again in its placement group and
        wait until it is up (a learner is built, at version 0: load the job's state next).

        Raises:
            TimeoutError: the actor did not come up (its placement group lost its node).
        """
        c = self.cells[cell]
        old = getattr(c, which)
        kill(old)
        actor = self.spawn(cell, c.pg, which)
        ready = actor.build.remote() if which == "learner" else actor.num_live_runs.remote()
        try:
            ray.get(ready, timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            kill(actor)
            raise TimeoutError(f"cell {cell}: new {which} not up within {timeout_s:g} s") from None
        setattr(c, which, actor)
        self.actors_replaced += 1
        return actor

    def push_weights(self, cells: Sequence[int], weights: Any, version: int) -> list[int]:
        """Load ``weights`` (a ref) at ``version`` into the engines of ``cells`` (each runner
        applies them between engine batches) and wait; returns the cells whose runner died."""
        pushes = {c: self.cells[c].runner.set_weights.remote(weights, version) for c in cells}
        failed = []
        for cell, ref in pushes.items():
            try:
                ray.get(ref)
            except ray.exceptions.RayError as exc:
                if not actor_lost(exc):
                    raise
                failed.append(cell)
        return failed

    def placed(self, cell: int) -> bool:
        """Whether ``cell``'s placement group holds all its bundles on alive nodes."""
        from ray.util import placement_group_table

        table = placement_group_table(self.cells[cell].pg)
        if table.get("state") != "CREATED":
            return False
        alive = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
        return all(node in alive for node in table.get("bundles_to_node_id", {}).values())

    def stop_actors(self, cell: int) -> None:
        """Stop ``cell``'s runner and learner for good (every rank of a sharded learner)."""
        for actor in (self.cells[cell].runner, self.cells[cell].learner):
            kill(actor)

    def shutdown(self) -> None:
        """Stop the actors and remove the placement groups."""
        for cell in self.cells:
            for actor in (cell.runner, cell.learner):
                kill(actor)
            remove_placement_group(cell.pg)


def create_cells(layout: CellLayout, *, actors: CellActors,
                 ready_timeout_s: float = 120.0) -> CellPool:
    """Validate ``layout`` against the cluster, create one placement group per cell and start
    the runner and learner of ``actors`` in each (blocking until all are up).

    Raises:
        LayoutError: the layout does not fit the cluster's alive nodes.
        EngineLayoutError: ``actors.engines`` does not divide the cell's GPUs.
    """
    t0 = time.perf_counter()
    nodes = [n["Resources"] for n in ray.nodes() if n["Alive"]]
    check_layout(layout, nodes)
    if actors.engines is not None:
        actors.engines.check(nodes_per_cell=layout.nodes_per_cell,
                             gpus_per_node=layout.gpus_per_node)
    pgs = [placement_group([layout.bundle()] * layout.nodes_per_cell, strategy=layout.strategy)
           for _ in range(layout.cells)]
    try:
        ray.get([pg.ready() for pg in pgs], timeout=ready_timeout_s)
    except ray.exceptions.GetTimeoutError:
        raise LayoutError(f"CellLayout: {layout.cells} placement groups of "
                          f"{layout.nodes_per_cell} × {layout.bundle()} not placed within "
                          f"{ready_timeout_s:g} s") from None
    probed = _probe_cuda(pgs, layout, all_bundles=actors.engine_actors) \
        if actors.sharded and actors.sharding.device == "cuda" else None
    held = probed if probed is not None and actors.engine_actors else [() for _ in pgs]
    pins: dict[int, str | None] = {}

    def pin(learners: dict[int, Any]) -> None:
        """The runners' pins: the GPU ids each learner holds, asked of all at once."""
        asked = {c: _ask_gpu_ids(actor, layout, actors) for c, actor in learners.items()}
        for index, refs in asked.items():
            try:         # a replaced learner on a lost node: keep the pin, replace() times out
                pins[index] = _gpu_ids(ray.get(refs, timeout=ready_timeout_s))
            except ray.exceptions.RayError as exc:   # or it died with its node: _wait_up
                if not (isinstance(exc, ray.exceptions.GetTimeoutError) or actor_lost(exc)):
                    raise

    def spawn(index: int, pg: Any, which: str) -> Any:
        actor = _start_actor(index, pg, which, layout, actors, held[index], pins.get(index))
        if which == "learner" and learner_holds_gpus(layout, actors):
            pin({index: actor})
        return actor

    # the learners first (the runners are pinned to their GPUs), started together: each one's
    # process starts while the others do, and their GPU ids are asked of all at once
    learners = [_start_actor(c, pg, "learner", layout, actors, held[c])
                for c, pg in enumerate(pgs)]
    if learner_holds_gpus(layout, actors):
        pin(dict(enumerate(learners)))
    cells = [Cell(c, pg, spawn(c, pg, "runner"), learners[c]) for c, pg in enumerate(pgs)]
    pool = CellPool(layout, cells, len(pgs), 0.0, spawn=spawn)
    _wait_up(pool, timeout_s=ready_timeout_s)
    pool.startup_s = time.perf_counter() - t0
    pool.initial_state = cells[0].learner.get_xlong_state.remote()
    pool.initial_weights = cells[0].learner.get_weights.remote()
    return pool


def _wait_up(pool: CellPool, *, timeout_s: float, attempts: int = 3) -> None:
    """Wait until every learner is built and every runner answers. An actor lost on the way
    (its node died while the cells were created: a node removed under a restarting driver) is
    started again in its placement group, which Ray places again on an alive node, at most
    ``attempts`` times (each new actor up within ``timeout_s``)."""
    waits = {(c.index, w): c.learner.build.remote() if w == "learner"
             else c.runner.num_live_runs.remote()
             for c in pool.cells for w in ("learner", "runner")}
    for (cell, which), ref in waits.items():
        try:
            ray.get(ref)
            continue
        except ray.exceptions.RayError as exc:
            if not actor_lost(exc):
                raise
        for attempt in range(attempts):
            try:
                pool.replace(cell, which, timeout_s=timeout_s)
                break
            except (ray.exceptions.RayError, TimeoutError) as exc:
                lost = isinstance(exc, TimeoutError) or actor_lost(exc)
                if attempt == attempts - 1 or not lost:
                    raise


def _probe_cuda(pgs: Sequence[Any], layout: CellLayout, *, all_bundles: bool = False
                ) -> list[list[tuple[str, ...]]]:
    """Per cell, the Ray GPU ids of bundle 0 (of every bundle with ``all_bundles``), each from
    a task holding them; removes the placement groups and raises when a task sees no CUDA
    device (logical GPUs)."""
    bundles = range(layout.nodes_per_cell if all_bundles else 1)
    refs = [[_bundle_gpus.options(num_gpus=layout.gpus_per_node,
                                  scheduling_strategy=PlacementGroupSchedulingStrategy(
                                      pg, placement_group_bundle_index=b)).remote()
             for b in bundles] for pg in pgs]
    probes = [ray.get(r) for r in refs]
    for cell, cell_probes in enumerate(probes):
        for b, (ids, count) in enumerate(cell_probes):
            if count < len(ids) or not ids:
                for pg in pgs:
                    remove_placement_group(pg)
                raise ShardingError(
                    f"ShardingSettings.device='cuda' but cell {cell}'s bundle {b} holds Ray GPUs"
                    f" {ids} and torch sees {count} CUDA devices there (logical GPUs?): use "
                    f"device='cpu'")
    return [[tuple(ids) for ids, _ in cell_probes] for cell_probes in probes]


@ray.remote(num_cpus=0)
def _bundle_gpus() -> tuple[list[str], int]:
    """(Ray GPU ids this task holds, CUDA devices torch sees)."""
    import torch

    return [str(i) for i in ray.get_gpu_ids()], torch.cuda.device_count()


def learner_holds_gpus(layout: CellLayout, actors: CellActors) -> bool:
    """Whether a cell's Learner (its ranks) holds bundle 0's GPUs in Ray's accounting: when
    the bundles have GPUs and the runner hosts the engines (engine actors hold them
    otherwise)."""
    return layout.gpus_per_node > 0 and not actors.engine_actors


def _ask_gpu_ids(learner: Any, layout: CellLayout, actors: CellActors) -> list[Any]:
    """Refs of the Ray GPU ids each of the Learner's ranks on bundle 0 holds."""
    if isinstance(learner, ShardedCell):
        per = ranks_per_bundle(actors.sharding, nodes_per_cell=layout.nodes_per_cell,
                               gpus_per_node=layout.gpus_per_node)
        ranks = learner.ranks[:per]
    else:
        ranks = [learner]
    return [r.__ray_call__.remote(_held_gpu_ids) for r in ranks]


def _gpu_ids(per_rank: list[list[str]]) -> str:
    """The ranks' GPU ids, sorted, comma-separated (``CUDA_VISIBLE_DEVICES``)."""
    return ",".join(sorted({i for ids in per_rank for i in ids}, key=lambda i: (len(i), i)))


def _held_gpu_ids(actor: Any) -> list[str]:
    return [str(i) for i in ray.get_gpu_ids()]


def _start_actor(index: int, pg: Any, which: str, layout: CellLayout,
                 actors: CellActors, gpu_ids: Sequence[Sequence[str]] = (),
                 pin: str | None = None) -> Any:
    """Start cell ``index``'s runner or learner on bundle 0 of ``pg`` (not waiting for it).
    The learner asks for bundle 0's GPUs (``learner_holds_gpus``; a sharded one's ranks ask
    for theirs, ``sharding.rank_placements``); the runner asks for none and, given ``pin``,
    sees those GPUs (``CUDA_VISIBLE_DEVICES``)."""
    on_cell = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=0)
    half = layout.cpus_per_bundle / 2
    if which == "runner":
        env = {} if pin is None else {"runtime_env": {"env_vars": {"CUDA_VISIBLE_DEVICES": pin}}}
        return ray.remote(concurrency_groups={"poll": 1})(actors.runner_class).options(
            num_cpus=half, num_gpus=0, scheduling_strategy=on_cell, **env).remote(
                cell=index, **actors.runner_kwargs)
    if actors.sharded:       # CPU ranks beside engine actors: the actors hold every GPU
        gpus = layout.gpus_per_node if (learner_holds_gpus(layout, actors) or gpu_ids) else 0
        return start_sharded_cell(pg=pg, settings=actors.learner_settings,
                                  sharding=actors.sharding, nodes_per_cell=layout.nodes_per_cell,
                                  gpus_per_node=gpus, held_gpu_ids=gpu_ids,
                                  batch_of=actors.batch_of)
    extra = {} if layout.learner_resource == "CPU" else {layout.learner_resource: 1.0}
    gpus = layout.gpus_per_node if learner_holds_gpus(layout, actors) else 0
    return ray.remote(actors.learner_class).options(
        num_cpus=half if not extra else 0, num_gpus=gpus, resources=extra,
        scheduling_strategy=on_cell).remote(**actors.learner_kwargs)
