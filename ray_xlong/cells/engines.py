"""Several engines per rollout cell: an ``EngineLayout`` and an ``EngineSet`` that pins each
run to one engine.

```
rollout cell, nodes_per_cell × gpus_per_node GPUs
  EngineLayout(engines_per_cell=E, tensor_parallel_size=T):  E · T divides the cell's GPUs
  EngineSet = engines 0 … E-1 behind the one-engine protocol (rollout.engine.Engine)
    generate  from a run's task ─► the engine it was pinned to at its first call (least
              loaded then); a run never moves (its context lives in that engine's prefix cache)
    update_weights / sleep / wake_up ─► every engine (weights: one copy in, E loads)
    live_runs per engine  ─►  the cell drains when all its engines are empty
```

A run is one asyncio task of the runner's loop (``AgentEnvRunner._start``), so the pin is
keyed by the calling task and dropped when it ends. The runner hands the set in through
``RolloutConfig.engine_factory`` (:func:`engine_set_factory`), so the runner is unchanged.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch


class EngineLayoutError(ValueError):
    """An engine layout that does not fit the cell's GPUs (the message names the numbers)."""


@dataclasses.dataclass(frozen=True, slots=True)
class EngineLayout:
    """How a rollout cell's GPUs are split into engines."""

    engines_per_cell: int = 1
    """Data-parallel engines on the cell (each serves its own runs)."""
    tensor_parallel_size: int = 1
    """GPUs per engine (vLLM ``tensor_parallel_size``; 1 on CPU)."""

    def __post_init__(self) -> None:
        for name in ("engines_per_cell", "tensor_parallel_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise EngineLayoutError(f"EngineLayout.{name} must be an int >= 1, got {value!r}")

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


class EngineSet:
    """Several engines behind the one-engine protocol; runs pinned (module docstring)."""

    def __init__(self, engines: Sequence[Any]) -> None:
        if not engines:
            raise ValueError("EngineSet.engines: need at least one engine")
        self.engines = list(engines)
        self.pins: dict[asyncio.Task, int] = {}
        self.runs_served = [0] * len(self.engines)

    # -- routing -------------------------------------------------------------------------------
    def engine_of(self, task: asyncio.Task | None) -> int:
        """The engine ``task``'s run is pinned to (pinning it to the least-loaded one first)."""
        if task is None:
            return 0
        if task not in self.pins:
            load = [0] * len(self.engines)
            for e in self.pins.values():
                load[e] += 1
            self.pins[task] = min(range(len(self.engines)), key=lambda e: (load[e], e))
            self.runs_served[self.pins[task]] += 1
            task.add_done_callback(lambda t: self.pins.pop(t, None))
        return self.pins[task]

    async def generate(self, input_ids: np.ndarray, *, sampling: Any) -> Any:
        engine = self.engines[self.engine_of(asyncio.current_task())]
        return await engine.generate(input_ids, sampling=sampling)

    # -- every engine --------------------------------------------------------------------------
    @property
    def policy_version(self) -> int:
        return min(e.policy_version for e in self.engines)

    @property
    def is_sleeping(self) -> bool:
        return any(getattr(e, "is_sleeping", False) for e in self.engines)

    def num_pending(self) -> int:
        """Requests waiting for a batch on any engine."""
        return sum(e.num_pending() for e in self.engines)

    @property
    def live_runs(self) -> list[int]:
        """Runs pinned to each engine now (a cell drains once every entry is 0)."""
        load = [0] * len(self.engines)
        for e in self.pins.values():
            load[e] += 1
        return load

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
        parts = [e.stats() for e in self.engines]
        fields = {f.name: sum(getattr(p, f.name) for p in parts)
                  for f in dataclasses.fields(parts[0])}
        return dataclasses.replace(parts[0], **fields)

    async def close(self) -> None:
        await asyncio.gather(*(e.close() for e in self.engines))


def engine_set_factory(layout: EngineLayout, make: Callable[[int, int], Any]
                       ) -> Callable[[], EngineSet]:
    """A ``RolloutConfig.engine_factory`` building ``layout.engines_per_cell`` engines with
    ``make(index, tensor_parallel_size)`` (e.g. an ``HFEngine`` on CPU, a ``VLLMEngine`` per
    GPU group on CUDA)."""
    def build() -> EngineSet:
        return EngineSet([make(i, layout.tensor_parallel_size)
                          for i in range(layout.engines_per_cell)])
    return build


def replicated_engine_set(layout: EngineLayout, factory: Callable[[], Any]
                          ) -> Callable[[], EngineSet]:
    """:func:`engine_set_factory` whose engines are each ``factory()`` (a picklable engine
    factory, e.g. ``RolloutConfig.engine_factory``; CPU engines: no tensor parallelism)."""
    if layout.tensor_parallel_size != 1:
        raise EngineLayoutError(f"replicated_engine_set: EngineLayout.tensor_parallel_size="
                                f"{layout.tensor_parallel_size}; give engine_set_factory a "
                                f"make(index, tp) instead")
    return engine_set_factory(layout, _Replica(factory))


@dataclasses.dataclass(frozen=True, slots=True)
class _Replica:
    """``make(index, tp) = factory()`` (picklable)."""

    factory: Callable[[], Any]
    """The engine factory every engine comes from."""

    def __call__(self, index: int, tensor_parallel_size: int) -> Any:
        return self.factory()
