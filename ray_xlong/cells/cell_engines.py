"""The engine factory a rollout cell's runner is given (``RolloutConfig.engine_factory``): a
:class:`CellEngines` builds the cell's ``EngineLayout`` where its ``placement`` puts it — an
``EngineSet`` in the runner's process (``engines.py``) or one engine actor each
(``engine_actors.py``). This module sits above both, so neither imports the other back.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from ray_xlong.cells.engine_actors import EngineActors, start_engine_actors
from ray_xlong.cells.engines import EngineLayout, EngineLayoutError, EngineSet


@dataclasses.dataclass(frozen=True, slots=True)
class CellEngines:
    """A ``RolloutConfig.engine_factory`` for a cell's engines (picklable; called in the
    runner's process, on its loop)."""

    layout: EngineLayout
    """How many engines, their size and where they live (``placement`` None: ``process``;
    ``rllib.cell_actors.cell_actors`` resolves it for the cell's device first)."""
    make: Callable[[int, int], Any]
    """``make(index, tensor_parallel_size) -> Engine``: builds engine ``index`` (in the
    runner's process, or in that engine's actor)."""

    def __call__(self) -> Any:
        if self.layout.placement == "actors":
            return start_engine_actors(self.layout, self.make)
        return EngineSet([self.make(i, self.layout.tensor_parallel_size)
                          for i in range(self.layout.engines_per_cell)])

    def resolve(self, device: str) -> CellEngines:
        """This factory with its layout's placement decided (:meth:`EngineLayout.resolve`)."""
        return dataclasses.replace(self, layout=self.layout.resolve(device))


def hosting(engine: Any) -> EngineSet | EngineActors:
    """``engine`` as an ``EngineHosting`` (``cells.protocols``): a :class:`CellEngines`'s
    ``EngineSet`` / ``EngineActors`` as it is, a single engine as a one-engine ``EngineSet`` — so
    a runner holds one kind of thing, whatever its factory built."""
    return engine if isinstance(engine, (EngineSet, EngineActors)) else EngineSet([engine])


def engine_set_factory(layout: EngineLayout, make: Callable[[int, int], Any]) -> CellEngines:
    """A ``RolloutConfig.engine_factory`` building ``layout.engines_per_cell`` engines with
    ``make(index, tensor_parallel_size)`` (e.g. an ``HFEngine`` on CPU, a ``VLLMEngine`` per
    GPU group on CUDA), where ``layout.placement`` puts them."""
    return CellEngines(layout, make)


def replicated_engine_set(layout: EngineLayout, factory: Callable[[], Any]) -> CellEngines:
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
