"""The contracts of the cell runtime, as ``typing.Protocol`` classes: what the actuator, recovery
and the learner group call on a cell's runner and Learner, what a runner calls on its engines,
what recovery and checkpointing may ask of the actuator, and what they need of the pool.

```
Runner        one cell's rollout actor     rllib.cell_actors.CellRunner; tests/cells/fakes.py
Learner       one cell's Learner actor     rllib.learner.XLongLearner, sharded.LearnerRank (each
                                           rank; sharded_cell.ShardedCell fans every call out)
EngineHosting a runner's engines           engines.EngineSet (in process),
                                           engine_actors.EngineActors (one actor per engine)
JobActions    the actuator's few actions   actuator.RayActuator (recovery, checkpoint use them)
CellHost      the cells                    pool.CellPool; tests/cells/fakes.FakePool
```

The driver calls runner and Learner methods on actor handles (``handle.name.remote(*args)``);
the protocols state the methods of the actor classes behind the handles. Role calls of a runner
take trailing ``after`` refs (ignored by the runner): the driver chains each call on the
previous one, since Ray does not order the calls of an actor with concurrency groups.
:func:`conformance` lists what keeps a class from a protocol (the contract tests use it).
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any, Mapping, Protocol, Sequence

if TYPE_CHECKING:
    import numpy as np
    import torch

    from ray_xlong.cells.learner_group import MicroBatch
    from ray_xlong.cells.runs import RunSpec
    from ray_xlong.trajectory.per_run import RunDigest


class Runner(Protocol):
    """A cell's rollout actor: runs, role calls, spooled runs, weights."""

    def start_runs(self, specs: Sequence[RunSpec], *after: Any) -> list[str]:
        """Start ``specs``; returns their run ids. Raises when draining or asleep."""

    def drain(self, *after: Any) -> None:
        """Take no new runs; live runs go on."""

    def suspend(self, *after: Any) -> float:
        """Rollout → training: drain and sleep the engines (raises with live runs). Returns
        seconds taken."""

    def resume(self, weights: Mapping[str, Any] | None, version: int, *after: Any) -> float:
        """Training → rollout: load ``weights`` of ``version`` (if given), wake, take runs."""

    def wait_ended(self, timeout_s: float) -> tuple[list[RunDigest], list[Any]]:
        """Runs ended since the last call, processed where they ended: their digests and their
        payload (two returns: the driver reads the digests, passes the payload's ref on)."""

    def process_spooled(self, run_ids: list[str]) -> tuple[list[RunDigest], list[Any]]:
        """Like :meth:`wait_ended` for runs read back from the spool (two returns)."""

    def set_weights(self, state_dict: Mapping[str, Any], version: int) -> None:
        """Load ``state_dict`` of ``version`` into every engine, between engine batches."""

    def receive_weights(self, spec: Any, version: int) -> float:
        """Receive ``version`` from the sender of ``spec``'s sync group (broadcast sync)."""

    def num_live_runs(self) -> int:
        """Runs started and not ended (also the pool's ready probe)."""


class Learner(Protocol):
    """A cell's Learner: the elastic step (``learner_group.ElasticLearnerGroup``), its state,
    and its sleep / wake cycle."""

    def build(self) -> Any:
        """Get ready (the pool's ready probe)."""

    def accumulate_runs(self, run_ids: Sequence[str], advantages: Sequence[float],
                        version: int | None, *payloads: Sequence[Any]) -> int:
        """Add the gradient of the runs ``run_ids`` (episodes in ``payloads``); returns their
        targets. Raises when asleep or at another ``version``."""

    def accumulate(self, micro_batch: Mapping[str, torch.Tensor],
                   version: int | None = None) -> int:
        """Add the gradient of one packed module batch; returns its targets."""

    def take_gradients(self) -> Mapping[str, torch.Tensor] | None:
        """The summed local gradient by name, then cleared (None on a rank that is not 0)."""

    def apply_step(self, grads: Sequence[Any], total: float, version: int) -> int:
        """One optimizer step with ``Σ grads / total``; returns ``version`` (= own + 1)."""

    def reduce_step(self, group: Any, total: float, version: int) -> int:
        """:meth:`apply_step` with the gradient all-reduced over ``group`` (a
        ``collectives.PeerGroup``; every member calls it; None: the only member); raises with
        the local gradient untouched when the collective fails."""

    def send_state(self, transfer: Any) -> int:
        """Send weights + optimizer state to the joiner of ``transfer`` (a
        ``collectives.StateFrom``), peer to peer; returns bytes sent."""

    def get_weights(self) -> Mapping[str, torch.Tensor]:
        """The weights engines load."""

    def send_weights(self, spec: Any, version: int) -> int:
        """Broadcast the weights of ``version`` to ``spec``'s sync group; returns bytes sent."""

    def get_xlong_state(self) -> Mapping[str, Any]:
        """Weights + optimizer state + version: what a joining Learner loads."""

    def set_xlong_state(self, state: Mapping[str, Any]) -> int:
        """Load :meth:`get_xlong_state` output; returns the version."""

    def wake_up(self, state: Any = None, after: Any = None) -> int:
        """Awake; load ``state`` (a :meth:`get_xlong_state` value or a
        ``collectives.StateFrom``) when its version differs. Returns the version."""

    def sleep(self) -> None:
        """Lend the cell's memory to the engines."""

    def take_step_stats(self, version: int) -> Any:
        """What this Learner did for the step that trained ``version`` (None: nothing)."""

    def save_checkpoint(self, path: str, files: Mapping[str, bytes] | None = None,
                        block: bool = False) -> str:
        """Start a DCP checkpoint of the state this Learner holds (each rank its shards) at
        ``path``; ``files`` (the driver's records) land in its parent once it is on disk."""

    def wait_checkpoint(self) -> str | None:
        """Block until the checkpoint in flight is on disk; its path (None: none)."""

    def load_checkpoint(self, path: str) -> int:
        """Load a :meth:`save_checkpoint` checkpoint; returns its version."""

    def export_hf(self, out: str) -> str:
        """Write the weights as a Hugging Face directory (``models/export.py``)."""


class EngineHosting(Protocol):
    """A runner's engines behind the one-engine protocol, each run pinned to one engine."""

    @property
    def policy_version(self) -> int:
        """Version of the weights every engine holds."""

    @property
    def is_sleeping(self) -> bool:
        """Whether the engines gave their memory away."""

    @property
    def live_runs(self) -> list[int]:
        """Runs pinned to each engine now."""

    @property
    def runs_served(self) -> list[int]:
        """Runs pinned to each engine so far."""

    def report(self) -> Any:
        """Runs per engine (``engines.EngineRouting``)."""

    async def generate(self, input_ids: np.ndarray, *, sampling: Any) -> Any:
        """One model call of the calling run, on the engine it is pinned to."""

    async def update_weights(self, state_dict: Mapping[str, torch.Tensor], *,
                             version: int) -> None:
        """Load new weights into every engine."""

    async def sleep(self) -> None:
        """Sleep every engine."""

    async def wake_up(self) -> None:
        """Wake every engine."""

    def num_pending(self) -> int:
        """Requests waiting for a batch on any engine."""

    def stats(self) -> Any:
        """The engines' counters added up (``EngineStats``)."""

    def engine_weights(self) -> list[dict[str, torch.Tensor]]:
        """Each engine's model weights (to check a sync)."""

    async def receive_weights(self, spec: Any, version: int) -> None:
        """Take part in ``spec``'s weight broadcast (``weight_sync``) and load what arrives
        into every engine between batches."""

    @property
    def vocab_size(self) -> int:
        """Ids every engine accepts: ``[0, vocab_size)``."""

    async def close(self) -> None:
        """Close every engine."""


class JobActions(Protocol):
    """What recovery and checkpointing may ask of the actuator besides changing the job state
    (``job_state.JobState``)."""

    def deliver(self, cell: int, digests: Sequence[RunDigest], payload: Any, *,
                payload_cell: int | None = None) -> None:
        """Runs that ended on ``cell`` (each taken once); ``payload``: their episodes' ref,
        processed on ``payload_cell`` (default ``cell``)."""

    def requeue(self, redo: list[MicroBatch]) -> list[MicroBatch]:
        """Put micro-batches a lost learner trained back at the head of the queue."""

    def rcall(self, cell: int, method: str, *args: Any) -> Any:
        """Call runner ``method`` of ``cell`` after its previous ordered call; returns a ref."""

    def watch_runs(self, cell: int) -> None:
        """Ask ``cell``'s runner for the runs that end next."""


class CellHost(Protocol):
    """The cells of a job and the two things recovery asks of where they live."""

    cells: list[Any]
    """By index, each with ``pg``, ``runner`` and ``learner`` (actor handles)."""
    placement_groups_created: int
    """Placement groups created (all at start-up)."""
    initial_state: Any
    """Ref of the Learners' version-0 state."""
    initial_weights: Any
    """Ref of the version-0 weights."""

    def replace(self, cell: int, which: str, *, timeout_s: float = 120.0) -> Any:
        """Start ``cell``'s ``runner`` or ``learner`` again; returns the new handle. Raises
        ``TimeoutError`` when it does not come up (its node is gone)."""

    def placed(self, cell: int) -> bool:
        """Whether ``cell``'s placement group holds all its bundles on alive nodes."""

    def stop_actors(self, cell: int) -> None:
        """Stop ``cell``'s runner and learner for good (every rank of a sharded learner)."""

    def push_weights(self, cells: Sequence[int], weights: Any, version: int) -> list[int]:
        """Load ``weights`` into the engines of ``cells``; returns cells whose runner died."""


def members(protocol: type) -> list[str]:
    """The method, property and attribute names ``protocol`` declares (its own, in order)."""
    names = [n for n, v in vars(protocol).items()
             if (not n.startswith("_") or n == "__ray_ready__")
             and (callable(v) or isinstance(v, property))]
    return names + [n for n in vars(protocol).get("__annotations__", {}) if n not in names]


RAY_TRACE_PARAMETER = "_ray_trace_ctx"
"""The keyword Ray adds to the signature of every method of a class made an actor
(``ray.remote(cls)`` sets ``__signature__`` on the class's own functions, tracing on or off):
not part of any contract."""


def _unbound(fn: Any) -> inspect.Signature:
    sig = inspect.signature(fn)
    params = [p for p in list(sig.parameters.values())[1:]               # without self
              if p.name != RAY_TRACE_PARAMETER]
    return sig.replace(parameters=params)


def _shape(fn: Any) -> list[tuple[str, Any]]:
    return [(p.name, p.kind) for p in _unbound(fn).parameters.values()]


def conformance(impl: Any, protocol: type) -> list[str]:
    """What keeps ``impl`` (a class, or an object whose attributes are set at construction)
    from the contract ``protocol``: each name it lacks, and each method whose parameters
    (names and kinds) differ. Empty: it conforms."""
    cls = impl if isinstance(impl, type) else type(impl)
    out = []
    for name in members(protocol):
        want, have = vars(protocol).get(name), inspect.getattr_static(impl, name, None)
        if have is None:
            out.append(f"{cls.__name__}.{name}: missing")
        elif inspect.isfunction(want) and inspect.isfunction(have) and \
                _shape(want) != _shape(have):
            out.append(f"{cls.__name__}.{name}{_unbound(have)} is not "
                       f"{protocol.__name__}.{name}{_unbound(want)}")
    return out
