"""Ray at the edge of the cell runtime: the object-store and actor-lifecycle calls that the
actuator, recovery, checkpointing and the learner group make, behind one small object.

```
JobState.ray : RayCalls ─┬─ RayEdge (this module): ray.get / ray.wait / ray.put,
                         │    ray.exceptions.RayError, actor_lost / actor_alive,
                         │    reduce_gradients (the sum tasks of a step), the driver's
                         │    rendezvous of the groups between cells (collectives.PeerGroups)
                         └─ an in-process fake (tests/cells/fakes.py): ready refs, no Ray
```

Actor calls keep Ray's handle syntax (``runner.resume.remote(weights, version)``): the handle
is what a pool hands out, so a fake pool hands out in-process handles with the same ``.remote``
(and the pool starts and stops its actors: ``protocols.CellHost``).
Everything else that talks to Ray from the runtime's logic goes through :class:`RayCalls`, so
that recovery and checkpoint logic run in unit tests without starting Ray. :class:`RayEdge`
calls Ray exactly as the runtime did before it was put behind this interface.
"""

from __future__ import annotations

from typing import Any, Protocol, Sequence

import ray

from ray_xlong.cells.reduce import reduce_gradients

KEEP_TASK_WORKERS = {"num_workers_soft_limit": 64}
"""``_system_config`` of every embedded Ray the package starts: keep idle task workers. Ray's
soft limit on idle workers is the node's (logical) CPU count; with two actors a cell a small
embedded Ray is always over it, so Ray killed every idle task worker and each task of a job (a
step's gradient sum, ``reduce._add``; a sharded cell's joins, ``rank_joins``) started a fresh
Python worker: 1-5 s of CPU each, dozens a step. (``RAY_num_workers_soft_limit`` in the
environment does the same for a Ray started elsewhere, e.g. by a test.) A cluster with real CPUs
per node stays under its limit and needs nothing."""


class RayCalls(Protocol):
    """What the runtime's logic asks of Ray besides actor calls."""

    Error: type[BaseException]
    """The exception a failed :meth:`get` raises (``ray.exceptions.RayError``)."""

    def get(self, refs: Any, *, timeout: float | None = None) -> Any:
        """The value of a ref (a list of values for a list of refs); raises ``Error``."""

    def wait(self, refs: Sequence[Any], *, num_returns: int,
             timeout: float | None) -> tuple[list[Any], list[Any]]:
        """``(ready, not ready)`` once ``num_returns`` are ready or ``timeout`` passed."""

    def put(self, value: Any) -> Any:
        """A ref holding ``value`` (in the driver's object store)."""

    def lost(self, exc: BaseException) -> bool:
        """Whether ``exc`` (from :meth:`get`) means an actor died."""

    def alive(self, actor: Any) -> bool:
        """False once ``actor`` is known dead (a busy actor counts as alive)."""

    def reduce(self, parts: Sequence[Any], *, scheme: str) -> list[Any]:
        """The ``apply_step`` argument summing gradient ``parts`` (``reduce.reduce_gradients``)."""

    def peer_groups(self) -> Any:
        """The rendezvous of the groups between cells (``collectives.PeerGroups``, made on
        first use), or None: reductions and state then go through the object store."""

    def kill(self, actor: Any) -> None:
        """Stop ``actor`` (every rank of a sharded cell's Learner)."""


def actor_lost(exc: BaseException) -> bool:
    """Whether ``exc`` (from ``ray.get``) means an actor died (directly or in a dependency)."""
    if isinstance(exc, (ray.exceptions.RayActorError, ray.exceptions.ObjectLostError)):
        return True
    cause = getattr(exc, "cause", None)
    return isinstance(cause, BaseException) and cause is not exc and actor_lost(cause)


def actor_alive(actor: Any) -> bool:
    """False once Ray reports ``actor`` dead (a busy actor counts as alive)."""
    try:
        ray.get(actor.__ray_ready__.remote(), timeout=2.0)
        return True
    except ray.exceptions.GetTimeoutError:
        return True
    except ray.exceptions.RayError as exc:
        if actor_lost(exc):
            return False
        raise


class RayEdge:
    """:class:`RayCalls` on a running Ray (what every job uses)."""

    Error = ray.exceptions.RayError
    collective_timeout_s: float = 60.0
    """Bound of every rendezvous and collective between cells (``PeerGroup.timeout_s``): a
    member lost mid-reduce costs the others this long before the object-store fallback."""

    def get(self, refs: Any, *, timeout: float | None = None) -> Any:
        return ray.get(refs, timeout=timeout)

    def wait(self, refs: Sequence[Any], *, num_returns: int,
             timeout: float | None) -> tuple[list[Any], list[Any]]:
        # readiness only: a ready object stays where it was made (no copy to the driver's node)
        return ray.wait(list(refs), num_returns=num_returns, timeout=timeout, fetch_local=False)

    def put(self, value: Any) -> Any:
        return ray.put(value)

    def lost(self, exc: BaseException) -> bool:
        return actor_lost(exc)

    def alive(self, actor: Any) -> bool:
        return actor_alive(actor)

    def reduce(self, parts: Sequence[Any], *, scheme: str) -> list[Any]:
        return reduce_gradients(parts, scheme=scheme)

    def kill(self, actor: Any) -> None:
        from ray_xlong.cells.sharded_cell import kill

        kill(actor)

    def peer_groups(self) -> Any:
        from ray_xlong.cells.collectives import PeerGroups

        if getattr(self, "_peer_groups", None) is None:
            self._peer_groups = PeerGroups(timeout_s=self.collective_timeout_s)
        return self._peer_groups
