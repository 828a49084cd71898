"""One Ray actor per engine of a rollout cell (``EngineLayout.placement='actors'``), and the
router the runner uses in place of an in-process ``EngineSet``.

```
cell placement group (nodes_per_cell bundles × gpus_per_node GPUs)
  bundle 0:  runner (no GPU in Ray's accounting) ── EngineActors (router, runner's loop)
                                                       │ run r ─► its pinned engine actor
  bundle b:  EngineActor i  {GPU: tensor_parallel_size}  ◄─┘  (engine i on bundle
             Ray sets its CUDA_VISIBLE_DEVICES to its own GPUs   i · share ÷ gpus_per_node,
             builds engine i with make(i, tp) in its process       share = cell GPUs ÷ E)
```

Why actors: ``CUDA_VISIBLE_DEVICES`` is per process, and Ray sets it for the runner's whole
bundle; engines in the runner's process would all see every GPU, and vLLM spawns its
tensor-parallel workers from the process that builds the engine. An actor per engine gets its
own GPUs from Ray and its own variable.

Invariants:
- The router keeps :class:`~ray_xlong.cells.engines.EngineSet`'s semantics (the same
  :class:`~ray_xlong.cells.engines.Pins`): a run is pinned to one engine actor at its first
  call (least loaded then) and never moves; ``live_runs`` per engine; the cell drains when all
  are empty. ``update_weights`` / ``sleep`` / ``wake_up`` / ``stats`` / ``close`` reach every
  actor.
- Engine actors die with their runner: the runner creates them, so it owns them, and Ray
  kills an actor whose owner died (a killed or crashed runner takes its engines with it;
  ``recovery.py`` rebuilds the runner, whose constructor starts new ones). The other way: an
  engine actor that dies makes the runner exit, so recovery sees one loss, the runner's, and
  rebuilds the cell's rollout side whole.

Weights (the design choice). Object store (``set_weights``): the runner receives the state dict
as today and puts it into the object store once; every engine actor fetches that one ref.
Broadcast (``receive_weights``, ``cells/broadcast.py``): the cell's first engine actor takes the
runner's rank in the sync group, receives the buckets on its own device (NCCL needs a GPU, and
the runner holds none; each bucket goes to host memory as it lands, so the device never holds
more than a bucket of staging), loads them, and returns those host weights by ref for the
cell's other engine actors (no ref when the cell has one engine). This keeps the sync group
one member per target cell, so ``broadcast.py`` and its fault handling are unchanged. Making
every engine actor a receiver would save the host hop and is left for when it is measured on
a GPU.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import ray
import torch

from ray_xlong.cells.engines import (EngineLayout, EngineLayoutError, EngineRouting, Pins,
                                    model_weights, sum_stats)


@dataclasses.dataclass(frozen=True, slots=True)
class EngineActorInfo:
    """What an engine actor reports once its engine is built."""

    index: int
    """Engine index in the cell (0 … engines_per_cell - 1)."""
    bundle: int
    """The cell's placement group bundle it runs in."""
    gpu_ids: tuple[str, ...]
    """Ray GPU ids it holds (``ray.get_gpu_ids()``; empty on a CPU cell)."""
    visible_devices: str | None
    """Its ``CUDA_VISIBLE_DEVICES`` (set by Ray from ``gpu_ids``)."""
    pid: int
    """Its process id (each engine lives in its own process)."""
    vocab_size: int = 0
    """Its engine's vocabulary size (ids it accepts: ``[0, vocab_size)``)."""


def engine_bundles(layout: EngineLayout, *, nodes_per_cell: int, gpus_per_node: int
                   ) -> list[int]:
    """The bundle of each engine (pure): engines spread evenly over the cell's GPUs, engine
    ``i`` on bundle ``i · share ÷ gpus_per_node`` (share = cell GPUs ÷ engines), or over the
    bundles on a cell without GPUs.

    Raises:
        EngineLayoutError: the layout does not fit the cell (``EngineLayout.check``).
    """
    share = layout.check(nodes_per_cell=nodes_per_cell, gpus_per_node=gpus_per_node)
    e = layout.engines_per_cell
    if share == 0:
        return [i * nodes_per_cell // e for i in range(e)]
    return [i * share // gpus_per_node for i in range(e)]


class EngineActor:
    """Hosts engine ``index`` (built by ``make(index, tensor_parallel_size)``) in its own
    process; an async actor, so requests of several runs batch in its engine's loop."""

    def __init__(self, make: Callable[[int, int], Any], index: int, tensor_parallel_size: int,
                 bundle: int) -> None:
        self.make, self.index, self.tp, self.bundle = make, index, tensor_parallel_size, bundle
        self.engine: Any = None

    async def build(self) -> EngineActorInfo:
        """Build the engine (on this actor's loop); returns where it runs."""
        self.engine = self.make(self.index, self.tp)
        return EngineActorInfo(self.index, self.bundle, tuple(str(g) for g in ray.get_gpu_ids()),
                               os.environ.get("CUDA_VISIBLE_DEVICES"), os.getpid(),
                               int(self.engine.vocab_size))

    async def generate(self, input_ids: np.ndarray, sampling: Any) -> Any:
        return await self.engine.generate(input_ids, sampling=sampling)

    async def update_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> int:
        """Load ``state_dict`` (a ref: fetched here) between batches; returns the version."""
        await self.engine.update_weights(state_dict, version=version)
        return self.engine.policy_version

    @ray.method(num_returns=2)
    async def receive_weights(self, spec: Any, version: int, share: bool
                              ) -> tuple[int, dict[str, torch.Tensor] | None]:
        """Take part in ``spec``'s broadcast (``weight_sync.SyncGroups``: on this actor's
        device; the weights arrive in host memory), load them, and return ``(version, those host
        weights for the cell's other engines, or None when not ``share``)``."""
        from ray_xlong.cells.weight_sync import sync_groups

        # host tensors (each bucket left the device as it landed): shared as they are
        state = await asyncio.to_thread(sync_groups(self).receive, spec, version)
        await self.engine.update_weights(state, version=version)
        return self.engine.policy_version, (state if share else None)

    async def sleep(self) -> None:
        await self.engine.sleep()

    async def wake_up(self) -> None:
        await self.engine.wake_up()

    async def close(self) -> None:
        await self.engine.close()

    def stats(self) -> Any:
        return self.engine.stats()

    def num_pending(self) -> int:
        return self.engine.num_pending()

    def policy_version(self) -> int:
        return self.engine.policy_version

    def model_weights(self) -> dict[str, torch.Tensor]:
        """The engine's model weights (``engines.model_weights``), to check a sync."""
        return model_weights(self.engine)


class EngineActors:
    """The runner's engines as actors, behind the one-engine protocol (module docstring)."""

    def __init__(self, actors: Sequence[Any], infos: Sequence[EngineActorInfo]) -> None:
        if not actors:
            raise ValueError("EngineActors.actors: need at least one engine actor")
        self.actors = list(actors)
        self.infos = list(infos)
        self.routing = Pins(len(self.actors))
        self._version = min(ray.get([a.policy_version.remote() for a in self.actors]))
        self._asleep = False

    @property
    def runs_served(self) -> list[int]:
        """Runs pinned to each engine actor so far."""
        return self.routing.runs_served

    @property
    def live_runs(self) -> list[int]:
        """Runs pinned to each engine actor now (a cell drains once every entry is 0)."""
        return self.routing.live_runs

    def report(self) -> EngineRouting:
        """Runs per engine actor, the actors and where they run (:class:`EngineRouting`)."""
        return EngineRouting(tuple(self.routing.runs_served), tuple(self.routing.live_runs),
                             tuple(self.actors), tuple(self.infos))

    @property
    def policy_version(self) -> int:
        """Version of the weights every engine holds (each change goes through this router)."""
        return self._version

    @property
    def is_sleeping(self) -> bool:
        return self._asleep

    @property
    def vocab_size(self) -> int:
        """Ids every engine accepts: ``[0, vocab_size)``."""
        return min(info.vocab_size for info in self.infos)

    async def generate(self, input_ids: np.ndarray, *, sampling: Any) -> Any:
        actor = self.actors[self.routing.engine_of(asyncio.current_task())]
        return await self._reach(actor.generate.remote(input_ids, sampling))

    async def update_weights(self, state_dict: Mapping[str, torch.Tensor], *,
                             version: int) -> None:
        """Put ``state_dict`` into the object store once; every engine actor fetches it."""
        ref = ray.put(dict(state_dict))
        await self._every(lambda a: a.update_weights.remote(ref, version))
        self._version = version

    async def receive_weights(self, spec: Any, version: int) -> None:
        """Broadcast sync: engine actor 0 receives for the cell, the others load its host copy
        (module docstring)."""
        first, *others = self.actors
        done, host = first.receive_weights.remote(spec, version, bool(others))
        await self._reach(done)
        await asyncio.gather(*(self._reach(a.update_weights.remote(host, version))
                               for a in others))
        self._version = version

    async def sleep(self) -> None:
        await self._every(lambda a: a.sleep.remote())
        self._asleep = True

    async def wake_up(self) -> None:
        await self._every(lambda a: a.wake_up.remote())
        self._asleep = False

    def num_pending(self) -> int:
        """Requests waiting for a batch on any engine actor."""
        return sum(ray.get([a.num_pending.remote() for a in self.actors]))

    def stats(self) -> Any:
        """The engine actors' counters added field by field (``EngineStats``)."""
        return sum_stats(ray.get([a.stats.remote() for a in self.actors]))

    def engine_weights(self) -> list[dict[str, torch.Tensor]]:
        """Each engine actor's model weights (to check what a sync delivered)."""
        return ray.get([a.model_weights.remote() for a in self.actors])

    async def close(self) -> None:
        """Close every engine, then end the actors."""
        try:
            await asyncio.gather(*(a.close.remote() for a in self.actors))
        except ray.exceptions.RayActorError:
            pass
        for a in self.actors:
            ray.kill(a, no_restart=True)

    async def _every(self, call: Callable[[Any], Any]) -> list[Any]:
        return await asyncio.gather(*(self._reach(call(a)) for a in self.actors))

    @staticmethod
    async def _reach(ref: Any) -> Any:
        """``await ref``; an engine actor that died ends this process (module docstring)."""
        try:
            return await ref
        except ray.exceptions.RayActorError as exc:
            print(f"an engine actor of this cell died ({exc!r}): the runner exits so that "
                  f"recovery rebuilds it with new engines", flush=True)
            os._exit(1)


def start_engine_actors(layout: EngineLayout, make: Callable[[int, int], Any],
                        *, timeout_s: float = 300.0) -> EngineActors:
    """Start one :class:`EngineActor` per engine of ``layout`` in the caller's (the runner's)
    placement group, each holding ``tensor_parallel_size`` of the cell's GPUs (none on a cell
    without GPUs), wait until every engine is built, and return the router.

    Raises:
        EngineLayoutError: the caller is in no placement group, or ``layout`` does not fit it.
    """
    from ray.util.placement_group import get_current_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    pg = get_current_placement_group()
    if pg is None:
        raise EngineLayoutError("EngineLayout.placement='actors' needs the runner in a cell's "
                                "placement group (cells.pool.create_cells)")
    specs = pg.bundle_specs
    gpus_per_node = int(specs[0].get("GPU", 0))
    bundles = engine_bundles(layout, nodes_per_cell=len(specs), gpus_per_node=gpus_per_node)
    gpus = layout.tensor_parallel_size if gpus_per_node else 0
    actors = [ray.remote(EngineActor).options(
        num_cpus=0, num_gpus=gpus, max_concurrency=1000,
        scheduling_strategy=PlacementGroupSchedulingStrategy(
            pg, placement_group_bundle_index=b)).remote(make, i, layout.tensor_parallel_size, b)
        for i, b in enumerate(bundles)]
    infos = ray.get([a.build.remote() for a in actors], timeout=timeout_s)
    return EngineActors(actors, infos)
