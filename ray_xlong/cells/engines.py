"""Several engines per rollout cell: an ``EngineLayout`` and an ``EngineSet`` that pins each
run to one engine.

```
rollout cell, nodes_per_cell × gpus_per_node GPUs
  EngineLayout(engines_per_cell=E, tensor_parallel_size=T, placement=P):  E · T divides the
                                                                           cell's GPUs
  P = process: EngineSet = engines 0 … E-1 in the runner's process, behind the one-engine
               protocol (rollout.engine.Engine)
  P = actors:  EngineActors = one Ray actor per engine with its T GPUs (cells/engine_actors.py),
               behind the same protocol and the same pinning
    generate  from a run's task ─► the engine it was pinned to at its first call (least
              loaded then); a run never moves (its context lives in that engine's prefix cache)
    update_weights / sleep / wake_up ─► every engine (weights: one copy in, E loads)
    live_runs per engine  ─►  the cell drains when all its engines are empty
```

A run is one asyncio task of the runner's loop (``AgentEnvRunner._start``), so the pin is
keyed by the calling task and dropped when it ends (:class:`Pins`, shared by both placements).
The runner hands the set in through ``RolloutConfig.engine_factory`` (``cell_engines.py``:
``engine_set_factory``, a ``CellEngines`` that builds either placement), so the runner is
unchanged.

Where the engines live (``EngineLayout.placement``): ``process`` keeps them in the runner's
process (fast to start, what CPU cells use); ``actors`` gives each its own actor in the cell's
placement group, so that Ray hands each engine its own GPUs and ``CUDA_VISIBLE_DEVICES`` (several
vLLM engines, or tensor-parallel workers, cannot share one process's view of a bundle's GPUs).
None resolves to ``actors`` on a CUDA cell, ``process`` otherwise (:meth:`EngineLayout.resolve`).
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any, Mapping, Sequence

import numpy as np
import torch

from ray_xlong.cells.weight_sync import sync_groups


PLACEMENTS = ("process", "actors")
"""``EngineLayout.placement`` values."""


class EngineLayoutError(ValueError):
    """An engine layout that does not fit the cell's GPUs (the message names the numbers)."""


@dataclasses.dataclass(frozen=True, slots=True)
class EngineLayout:
    """How a rollout cell's GPUs are split into engines."""

    engines_per_cell: int = 1
    """Data-parallel engines on the cell (each serves its own runs)."""
    tensor_parallel_size: int = 1
    """GPUs per engine (vLLM ``tensor_parallel_size``; 1 on CPU)."""
    placement: str | None = None
    """Where the engines live: ``process`` (all in the runner's process, an :class:`EngineSet`)
    or ``actors`` (one Ray actor per engine in the cell's placement group, holding its
    ``tensor_parallel_size`` GPUs: ``cells/engine_actors.py``). None: ``actors`` on a CUDA cell,
    ``process`` otherwise (:meth:`resolve`)."""

    def __post_init__(self) -> None:
        for name in ("engines_per_cell", "tensor_parallel_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise EngineLayoutError(f"EngineLayout.{name} must be an int >= 1, got {value!r}")
        if self.placement not in (None,) + PLACEMENTS:
            raise EngineLayoutError(f"EngineLayout.placement must be one of {PLACEMENTS} or "
                                    f"None, got {self.placement!r}")

    def resolve(self, device: str) -> EngineLayout:
        """This layout with ``placement`` decided for a cell on ``device`` (``cpu`` | ``cuda``,
        ``ShardingSettings.device``): None becomes ``actors`` on CUDA, ``process`` on CPU."""
        if self.placement is not None:
            return self
        return dataclasses.replace(self, placement="actors" if device == "cuda" else "process")

    def check(self, *, nodes_per_cell: int, gpus_per_node: int) -> int:
        """Validate against the cell (pure). Returns the GPUs each engine gets (0 on CPU).

        Raises:
            EngineLayoutError: ``engines_per_cell × tensor_parallel_size`` does not divide the
                cell's GPUs, or tensor parallelism on a cell without GPUs.
        """
        gpus = nodes_per_cell * gpus_per_node
        used = self.engines_per_cell * self.tensor_parallel_size
        if gpus == 0:
            if self.tensor_parallel_size > 1:
                raise EngineLayoutError(
                    f"EngineLayout.tensor_parallel_size={self.tensor_parallel_size} on a cell "
                    f"without GPUs (CellLayout.gpus_per_node={gpus_per_node})")
            return 0
        if gpus % used:
            raise EngineLayoutError(
                f"EngineLayout: engines_per_cell={self.engines_per_cell} × tensor_parallel_size"
                f"={self.tensor_parallel_size} = {used} GPUs does not divide the cell's "
                f"{gpus} GPUs (nodes_per_cell={nodes_per_cell} × gpus_per_node={gpus_per_node})")
        if self.tensor_parallel_size > gpus_per_node:
            raise EngineLayoutError(
                f"EngineLayout.tensor_parallel_size={self.tensor_parallel_size} spans nodes "
                f"(CellLayout.gpus_per_node={gpus_per_node}); keep an engine on one node")
        return gpus // self.engines_per_cell


class Pins:
    """Which engine each run (an asyncio task of the runner's loop) is pinned to: the least
    loaded one at its first call; the pin is dropped when the task ends."""

    def __init__(self, engines: int) -> None:
        self.engines = engines
        self.pins: dict[asyncio.Task, int] = {}
        self.runs_served = [0] * engines
        """Runs pinned to each engine so far."""

    def engine_of(self, task: asyncio.Task | None) -> int:
        """The engine ``task``'s run is pinned to (pinning it to the least-loaded one first)."""
        if task is None:
            return 0
        if task not in self.pins:
            load = self.live_runs
            self.pins[task] = min(range(self.engines), key=lambda e: (load[e], e))
            self.runs_served[self.pins[task]] += 1
            task.add_done_callback(lambda t: self.pins.pop(t, None))
        return self.pins[task]

    @property
    def live_runs(self) -> list[int]:
        """Runs pinned to each engine now (a cell drains once every entry is 0)."""
        load = [0] * self.engines
        for e in self.pins.values():
            load[e] += 1
        return load


@dataclasses.dataclass(frozen=True, slots=True)
class EngineRouting:
    """Where a cell's runs went, per engine (``CellRunner.engine_routing``)."""

    runs_served: tuple[int, ...]
    """Runs pinned to each engine so far."""
    live_runs: tuple[int, ...]
    """Runs pinned to each engine now."""
    actors: tuple[Any, ...] = ()
    """Engine actor handles (``placement='actors'``; empty in the runner's process)."""
    infos: tuple[Any, ...] = ()
    """Their ``engine_actors.EngineActorInfo`` (GPU ids, ``CUDA_VISIBLE_DEVICES``, pid)."""


def model_weights(engine: Any) -> dict[str, torch.Tensor]:
    """A host copy of ``engine``'s model weights (``{}`` for an engine without a torch model),
    to check what a sync delivered."""
    model = getattr(engine, "model", None)
    if not isinstance(model, torch.nn.Module):
        return {}
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


def sum_stats(parts: Sequence[Any]) -> Any:
    """Engines' counters (``EngineStats``) added field by field."""
    fields = {f.name: sum(getattr(p, f.name) for p in parts)
              for f in dataclasses.fields(parts[0])}
    return dataclasses.replace(parts[0], **fields)


class EngineSet:
    """Several engines in the runner's process behind the one-engine protocol; runs pinned
    (module docstring)."""

    def __init__(self, engines: Sequence[Any]) -> None:
        if not engines:
            raise ValueError("EngineSet.engines: need at least one engine")
        self.engines = list(engines)
        self.routing = Pins(len(self.engines))

    @property
    def runs_served(self) -> list[int]:
        """Runs pinned to each engine so far."""
        return self.routing.runs_served

    def report(self) -> EngineRouting:
        """Runs per engine (:class:`EngineRouting`)."""
        return EngineRouting(tuple(self.routing.runs_served), tuple(self.routing.live_runs))

    async def generate(self, input_ids: np.ndarray, *, sampling: Any) -> Any:
        engine = self.engines[self.routing.engine_of(asyncio.current_task())]
        return await engine.generate(input_ids, sampling=sampling)

    # -- every engine --------------------------------------------------------------------------
    @property
    def policy_version(self) -> int:
        return min(e.policy_version for e in self.engines)

    @property
    def is_sleeping(self) -> bool:
        return any(getattr(e, "is_sleeping", False) for e in self.engines)

    @property
    def vocab_size(self) -> int:
        """Ids every engine accepts: ``[0, vocab_size)``."""
        return min(e.vocab_size for e in self.engines)

    def num_pending(self) -> int:
        """Requests waiting for a batch on any engine."""
        return sum(e.num_pending() for e in self.engines)

    @property
    def live_runs(self) -> list[int]:
        """Runs pinned to each engine now (a cell drains once every entry is 0)."""
        return self.routing.live_runs

    async def update_weights(self, state_dict: Mapping[str, torch.Tensor], *,
                             version: int) -> None:
        await asyncio.gather(*(e.update_weights(state_dict, version=version)
                               for e in self.engines))

    async def sleep(self) -> None:
        await asyncio.gather(*(e.sleep() for e in self.engines))

    async def wake_up(self) -> None:
        await asyncio.gather(*(e.wake_up() for e in self.engines))

    def stats(self) -> Any:
        """The engines' counters added field by field (``EngineStats``)."""
        return sum_stats([e.stats() for e in self.engines])

    def engine_weights(self) -> list[dict[str, torch.Tensor]]:
        """Each engine's model weights (:func:`model_weights`)."""
        return [model_weights(e) for e in self.engines]

    async def receive_weights(self, spec: Any, version: int) -> None:
        """Take part in ``spec``'s broadcast (``weight_sync.SyncGroups``, in this process: the
        engines share it) off the loop, then load the weights into every engine between
        batches."""
        state = await asyncio.to_thread(sync_groups(self).receive, spec, version)
        await self.update_weights(state, version=version)

    async def close(self) -> None:
        await asyncio.gather(*(e.close() for e in self.engines))
