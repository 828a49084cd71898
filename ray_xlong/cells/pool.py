"""Cells as Ray placement groups: created once, each hosting an engine runner and a Learner.

```
cell c = placement group, strategy STRICT_SPREAD (one bundle per node) or PACK
  bundle 0 {CPU: cpus_per_bundle, GPU: gpus_per_node [, learner_resource: 1]}  ◄─ CellRunner
  bundle 1 … nodes_per_cell-1 (the cell's other nodes)                               XLongLearner
```

Both actors of a cell share bundle 0 (half its CPUs each; the runner takes the logical GPUs).
The Learner never asks for "GPU" on a host without CUDA (RLlib's NCCL path fails on logical
GPUs): it takes CPU from the bundle, or ``learner_resource`` when one is configured. A role
switch sleeps one actor and wakes the other; placement groups are never created after
:func:`create_cells` (``CellPool.placement_groups_created`` counts them).

:func:`check_layout` is pure: it validates a layout against node resources before anything is
created and names the numbers when it cannot fit.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Mapping, Sequence

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from ray_xlong.rllib.env_runner import AgentEnvRunner, RolloutConfig
from ray_xlong.rllib.learner import LearnerSettings, XLongLearner, learner_config
from ray_xlong.cells.spool import RunSpool
from ray_xlong.rollout.tasks import TASKS, TaskFactory, register_task

STRATEGIES = ("STRICT_SPREAD", "PACK", "SPREAD", "STRICT_PACK")


class LayoutError(ValueError):
    """The cell layout cannot be placed on the cluster (the message names the numbers)."""


@dataclasses.dataclass(frozen=True, slots=True)
class CellLayout:
    """How cells map onto nodes."""

    cells: int
    """Number of cells."""
    nodes_per_cell: int = 1
    """Bundles (nodes) per cell."""
    gpus_per_node: int = 1
    """GPUs per bundle (logical GPUs on this machine)."""
    cpus_per_bundle: float = 1.0
    """CPUs per bundle (the runner and the learner take half each)."""
    strategy: str = "STRICT_SPREAD"
    """Placement strategy of a cell's bundles."""
    learner_resource: str = "CPU"
    """``CPU``, or a custom resource name the learner takes one unit of."""

    def __post_init__(self) -> None:
        for name in ("cells", "nodes_per_cell"):
            if getattr(self, name) < 1:
                raise ValueError(f"CellLayout.{name} must be >= 1, got {getattr(self, name)!r}")
        if self.gpus_per_node < 0 or not self.cpus_per_bundle > 0:
            raise ValueError(f"CellLayout.gpus_per_node must be >= 0 and cpus_per_bundle > 0, "
                             f"got {self.gpus_per_node!r}, {self.cpus_per_bundle!r}")
        if self.strategy not in STRATEGIES:
            raise ValueError(f"CellLayout.strategy must be one of {STRATEGIES}, "
                             f"got {self.strategy!r}")
        if self.learner_resource in ("GPU", ""):
            raise ValueError("CellLayout.learner_resource must be 'CPU' or a custom resource "
                             "(a learner asking for logical GPUs would try NCCL)")

    def bundle(self) -> dict[str, float]:
        """Resources of one bundle."""
        out = {"CPU": self.cpus_per_bundle}
        if self.gpus_per_node:
            out["GPU"] = float(self.gpus_per_node)
        if self.learner_resource != "CPU":
            out[self.learner_resource] = 1.0
        return out


def check_layout(layout: CellLayout, nodes: Sequence[Mapping[str, float]]) -> None:
    """Raise :class:`LayoutError` when ``layout`` cannot fit ``nodes`` (resource dicts).

    A node holds ``min over resources ⌊node[r] / bundle[r]⌋`` bundles; STRICT_SPREAD needs
    ``nodes_per_cell`` distinct nodes per cell.
    """
    need = layout.bundle()
    fits = [min(int(n.get(r, 0.0) // v) for r, v in need.items()) for n in nodes]
    total = layout.cells * layout.nodes_per_cell
    spread = layout.strategy == "STRICT_SPREAD"
    usable = sum(min(f, layout.cells) if spread else f for f in fits)
    hosts = sum(1 for f in fits if f > 0)
    if spread and hosts < layout.nodes_per_cell:
        raise LayoutError(
            f"CellLayout: STRICT_SPREAD cells of nodes_per_cell={layout.nodes_per_cell} need "
            f"that many nodes with a free bundle {need} (gpus_per_node={layout.gpus_per_node}),"
            f" the cluster has {hosts} of {len(nodes)}")
    if usable < total:
        raise LayoutError(
            f"CellLayout: {layout.cells} cells × nodes_per_cell={layout.nodes_per_cell} = "
            f"{total} bundles of {need} (gpus_per_node={layout.gpus_per_node}), the cluster's "
            f"{len(nodes)} nodes hold {usable}")
    if layout.strategy == "STRICT_PACK" and max(fits, default=0) < layout.nodes_per_cell:
        raise LayoutError(f"CellLayout: STRICT_PACK puts {layout.nodes_per_cell} bundles of "
                          f"{need} on one node; the largest node holds {max(fits, default=0)}")


class CellRunner(AgentEnvRunner):
    """The cell's rollout side: :class:`AgentEnvRunner` plus the calls a role switch makes.

    ``wait_ended`` runs in its own concurrency group so that it can block without delaying
    ordered role calls (``suspend`` / ``resume`` / ``start_runs`` keep submission order).
    """

    def __init__(self, *, config: Any, rollout_config: RolloutConfig,
                 tasks: Mapping[str, TaskFactory], cell: int = -1,
                 spool_dir: str | None = None) -> None:
        for name, factory in tasks.items():
            if name not in TASKS:
                register_task(name, factory)
        self.cell = cell
        self.spool = RunSpool(spool_dir) if spool_dir else None
        super().__init__(config=config, rollout_config=rollout_config)

    def _on_end(self, run_id: str, env, task) -> None:
        # Spool first, then hand over: a runner that dies in between loses nothing. A spool
        # that fails (disk full) still hands the run over, and the error reaches the driver
        # through wait_ended (never a run that silently never ends).
        try:
            if self.spool is not None and not task.cancelled() and task.exception() is None:
                self.spool.put(self.cell, task.result())
        except Exception as exc:  # noqa: BLE001 - reported by wait_ended
            self._spool_error = exc
        finally:
            super()._on_end(run_id, env, task)

    @ray.method(concurrency_group="poll")
    def wait_ended(self, timeout_s: float) -> list:
        """The :class:`RunResult` of runs ended since the last call; waits up to
        ``timeout_s`` for at least one."""
        deadline = time.monotonic() + timeout_s
        while not self._ended and time.monotonic() < deadline:
            time.sleep(0.002)
        error = getattr(self, "_spool_error", None)
        if error is not None:
            raise RuntimeError(f"cell {self.cell}: spooling an ended run failed: {error!r}")
        return self.sample_results()

    # Role calls take trailing ``after`` refs (ignored): the driver chains each call on the
    # previous one, since Ray does not order the calls of an actor with concurrency groups.
    def start_runs(self, specs, *after: Any) -> list[str]:
        """:meth:`AgentEnvRunner.start_runs` (``after``: refs to wait for)."""
        return super().start_runs(specs)

    def drain(self, *after: Any) -> None:
        """:meth:`AgentEnvRunner.drain` (``after``: refs to wait for)."""
        super().drain()

    def suspend(self, *after: Any) -> float:
        """Rollout → training: drain and sleep the engine (raises with live runs). Returns
        the seconds it took."""
        t = time.perf_counter()
        self.drain()
        self.sleep()
        return time.perf_counter() - t

    def resume(self, weights: Mapping[str, Any] | None, version: int, *after: Any) -> float:
        """Training → rollout: load ``weights`` of ``version`` (if given), wake, take runs
        again. ``after`` is ignored: pass refs (the learner's sleep, this runner's own pending
        ``suspend``) to make Ray run this once they resolved — calls of an actor with
        concurrency groups are not guaranteed to run in submission order. Returns the seconds
        it took."""
        t = time.perf_counter()
        if weights is not None:
            self.set_weights(weights, version)
        self.wake_up()
        self.undrain()
        return time.perf_counter() - t


@dataclasses.dataclass(slots=True)
class Cell:
    """One cell: its placement group and the two actors sharing bundle 0."""

    index: int
    """Cell index."""
    pg: Any
    """The placement group (kept for the whole job)."""
    runner: Any
    """``CellRunner`` actor."""
    learner: Any
    """``XLongLearner`` actor (built)."""


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
        ray.kill(old, no_restart=True)
        actor = self.spawn(cell, c.pg, which)
        ready = actor.build.remote() if which == "learner" else actor.num_live_runs.remote()
        try:
            ray.get(ready, timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            ray.kill(actor, no_restart=True)
            raise TimeoutError(f"cell {cell}: new {which} not up within {timeout_s:g} s") from None
        setattr(c, which, actor)
        self.actors_replaced += 1
        return actor

    def placed(self, cell: int) -> bool:
        """Whether ``cell``'s placement group holds all its bundles on alive nodes."""
        from ray.util import placement_group_table

        table = placement_group_table(self.cells[cell].pg)
        if table.get("state") != "CREATED":
            return False
        alive = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
        return all(node in alive for node in table.get("bundles_to_node_id", {}).values())

    def shutdown(self) -> None:
        """Stop the actors and remove the placement groups."""
        for cell in self.cells:
            for actor in (cell.runner, cell.learner):
                ray.kill(actor)
            remove_placement_group(cell.pg)


def create_cells(layout: CellLayout, *, rollout: RolloutConfig, learner: LearnerSettings,
                 tasks: Mapping[str, TaskFactory] | None = None, seed: int = 0,
                 ready_timeout_s: float = 120.0, spool_dir: str | None = None) -> CellPool:
    """Validate ``layout`` against the cluster, create one placement group per cell and start
    a runner and a learner in each (blocking until all are up).

    Raises:
        LayoutError: the layout does not fit the cluster's alive nodes.
    """
    t0 = time.perf_counter()
    nodes = [n["Resources"] for n in ray.nodes() if n["Alive"]]
    check_layout(layout, nodes)
    pgs = [placement_group([layout.bundle()] * layout.nodes_per_cell, strategy=layout.strategy)
           for _ in range(layout.cells)]
    try:
        ray.get([pg.ready() for pg in pgs], timeout=ready_timeout_s)
    except ray.exceptions.GetTimeoutError:
        raise LayoutError(f"CellLayout: {layout.cells} placement groups of "
                          f"{layout.nodes_per_cell} × {layout.bundle()} not placed within "
                          f"{ready_timeout_s:g} s") from None
    def spawn(index: int, pg: Any, which: str) -> Any:
        return _start_actor(index, pg, which, layout, rollout, learner, dict(tasks or {}), seed,
                            spool_dir)

    cells = [Cell(c, pg, spawn(c, pg, "runner"), spawn(c, pg, "learner"))
             for c, pg in enumerate(pgs)]
    ray.get([cell.learner.build.remote() for cell in cells])
    ray.get([cell.runner.num_live_runs.remote() for cell in cells])
    pool = CellPool(layout, cells, len(pgs), time.perf_counter() - t0, spawn=spawn)
    pool.initial_state = cells[0].learner.get_xlong_state.remote()
    pool.initial_weights = cells[0].learner.get_weights.remote()
    return pool


def _start_actor(index: int, pg: Any, which: str, layout: CellLayout, rollout: RolloutConfig,
                 learner: LearnerSettings, tasks: dict, seed: int, spool_dir: str | None) -> Any:
    """Start cell ``index``'s runner or learner on bundle 0 of ``pg`` (not waiting for it)."""
    on_cell = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=0)
    half = layout.cpus_per_bundle / 2
    if which == "runner":
        from ray.rllib.algorithms.algorithm_config import AlgorithmConfig

        return ray.remote(concurrency_groups={"poll": 1})(CellRunner).options(
            num_cpus=half, num_gpus=layout.gpus_per_node, scheduling_strategy=on_cell).remote(
                config=AlgorithmConfig(), rollout_config=rollout, tasks=tasks, cell=index,
                spool_dir=spool_dir)
    extra = {} if layout.learner_resource == "CPU" else {layout.learner_resource: 1.0}
    config, spec = learner_config(learner, seed=seed)
    return ray.remote(XLongLearner).options(
        num_cpus=half if not extra else 0, num_gpus=0, resources=extra,
        scheduling_strategy=on_cell).remote(config=config, module_spec=spec)
