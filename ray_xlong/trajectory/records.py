"""Token-exact records of an agent run: :class:`ModelCall` and :class:`AgentRun`.

A ``ModelCall`` is one request to the inference engine, recorded exactly as the engine saw it:
``input_ids`` is the full context sent, ``output_ids`` exactly what it generated, one behaviour
logprob per output token. A ``AgentRun`` is one agent attempt at one task: its calls in the order
they were issued, its reward and how it ended.

Invariants (checked at construction; every error names the field and the run / call):

* Token in, token out: ids are stored as the caller gave them when they already are 1-D integer
  numpy arrays (no copy, so a paper-scale run whose inputs are views of one growing context stays
  one buffer); lists are converted once to ``int64`` arrays. Nothing is ever re-tokenized.
* ``len(output_logprobs) == len(output_ids)``; logprobs are finite and ``<= 0``.
* Ids are non-negative integers that fit int64; ``input_ids`` is never empty.
* ``kind`` is one of :data:`CALL_KINDS`; a ``subagent`` call names its ``parent_agent_id``;
  within a run, parents exist, call ids are unique, an agent's calls of one kind name one
  parent.
* ``status`` is one of :data:`RUN_STATUSES`; ``reward`` is finite.

Arrays are marked read-only on the record (a view is made when the caller's array is writable,
so the caller's own buffer is left as it was).

A run that reached its consumer without construction (unpickled: ``__post_init__`` does not run;
a field overwritten) is checked again by :func:`check_run`, which the trajectory processor calls.
"""

from __future__ import annotations

import dataclasses
import math
import weakref
from typing import Literal, Sequence

import numpy as np

CallKind = Literal["main", "summary", "subagent"]
RunStatus = Literal["finished", "timeout", "failed"]

CALL_KINDS: tuple[str, ...] = ("main", "summary", "subagent")
RUN_STATUSES: tuple[str, ...] = ("finished", "timeout", "failed")


class RecordError(ValueError):
    """A record is malformed. The message names the offending field and the run / call."""


def _where(run_id: str | None, call_id: str | None) -> str:
    parts = []
    if run_id is not None:
        parts.append(f"run {run_id!r}")
    if call_id is not None:
        parts.append(f"call {call_id!r}")
    return ", ".join(parts) or "record"


def as_token_array(ids: object, *, field: str, where: str, allow_empty: bool,
                   scan: bool = True, vocab_size: int | None = None) -> np.ndarray:
    """Validate token ids and return them as a read-only 1-D integer array.

    Args:
        ids: a sequence of ints or a 1-D integer numpy array (shape ``[n]``).
        field: the field name, for errors.
        where: the run / call, for errors.
        allow_empty: whether ``n == 0`` is valid.
        scan: whether to check the values (no negative id, none ``>= vocab_size``); False
            checks type, dtype and shape only (O(1)).
        vocab_size: when given (and ``scan``), ids must be ``< vocab_size``.

    Returns:
        A read-only ``[n]`` integer array; the caller's array itself when it already was one
        (or a read-only view of it), so no token is copied.
    """
    if isinstance(ids, np.ndarray):
        arr = ids
        if arr.dtype.kind not in "iu":
            raise RecordError(f"{where}: {field} must hold integers, got dtype {arr.dtype}")
    else:
        if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence):
            raise RecordError(f"{where}: {field} must be a list or 1-D integer array, "
                              f"got {type(ids).__name__}")
        if not all(isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in ids):
            bad = next(t for t in ids
                       if not isinstance(t, (int, np.integer)) or isinstance(t, bool))
            raise RecordError(f"{where}: {field} must hold integers, found {bad!r}")
        arr = np.asarray(ids, dtype=np.int64)
    if arr.ndim != 1:
        raise RecordError(f"{where}: {field} must be 1-D, got shape {arr.shape}")
    if arr.size == 0 and not allow_empty:
        raise RecordError(f"{where}: {field} is empty")
    if scan and arr.size:
        _check_id_range(arr, field=field, where=where, vocab_size=vocab_size)
    return _read_only(arr)


_INT64_MAX = int(np.iinfo(np.int64).max)


# -- append-only buffers: a context's range check costs its new ids, not the whole context -----
_SCANNED: dict[int, list] = {}
"""``id(buffer)`` → ``[ids scanned from its start, their min, their max]`` for buffers declared
append-only (:func:`append_only`)."""


def append_only(buf: np.ndarray, *, grown_from: np.ndarray | None = None) -> None:
    """Declare ``buf`` append-only: ids below a position once read are never rewritten (the
    harness's ``Context``, the endpoint's ``IdBuffer``). The range check of a view ``buf[:n]``
    (a call's ``input_ids``) then scans only the ids appended since the last check, so
    recording a call of a 1M-token context costs its new tokens, not the whole context.
    ``grown_from``: the buffer ``buf`` copied its prefix from (what was scanned there holds)."""
    state = [0, 0, 0]
    old = _SCANNED.get(id(grown_from)) if grown_from is not None else None
    if old is not None:
        state = list(old)
    _SCANNED[id(buf)] = state
    weakref.finalize(buf, _SCANNED.pop, id(buf), None)


def id_range(arr: np.ndarray) -> tuple[int, int]:
    """``(min, max)`` of a non-empty 1-D integer array. A view ``buf[:n]`` of an
    :func:`append_only` buffer that reaches past what an earlier call scanned there scans only
    the ids past it; any other array (a shorter prefix included) is scanned whole."""
    base = arr.base
    state = _SCANNED.get(id(base)) if isinstance(base, np.ndarray) else None
    if state is None or arr.size <= state[0] or base.dtype != arr.dtype or base.ndim != 1 \
            or arr.strides != base.strides \
            or arr.__array_interface__["data"][0] != base.__array_interface__["data"][0]:
        return int(arr.min()), int(arr.max())
    done, lo, hi = state
    new = arr[done:]
    nlo, nhi = int(new.min()), int(new.max())
    lo, hi = (nlo, nhi) if done == 0 else (min(lo, nlo), max(hi, nhi))
    state[:] = [arr.size, lo, hi]
    return lo, hi


def _check_id_range(arr: np.ndarray, *, field: str, where: str, vocab_size: int | None) -> None:
    """No negative id, none that overflows int64 (uint64 input), none ``>= vocab_size``."""
    lo, hi = id_range(arr)
    if lo < 0:
        raise RecordError(f"{where}: {field} holds a negative id ({lo})")
    if hi > _INT64_MAX:
        raise RecordError(f"{where}: {field} holds an id beyond int64 ({hi})")
    if vocab_size is not None and hi >= vocab_size:
        raise RecordError(f"{where}: {field} holds id {hi}, outside the vocabulary "
                          f"[0, {vocab_size})")


def _read_only(arr: np.ndarray) -> np.ndarray:
    if arr.flags.writeable:
        arr = arr.view()
        arr.flags.writeable = False
    return arr


def as_logprobs(values: object, *, n: int, where: str) -> np.ndarray:
    """Validate behaviour logprobs: ``[n]`` finite floats ``<= 0`` (read-only on return).

    Raises:
        RecordError: naming ``where`` and the problem (length, NaN / inf, positive value).
    """
    arr = np.asarray(values, dtype=np.float64) if not isinstance(values, np.ndarray) else values
    if arr.dtype.kind != "f":
        try:
            arr = arr.astype(np.float64)
        except (TypeError, ValueError) as exc:
            raise RecordError(f"{where}: output_logprobs must be floats ({exc})") from exc
    if arr.ndim != 1:
        raise RecordError(f"{where}: output_logprobs must be 1-D, got shape {arr.shape}")
    if arr.size != n:
        raise RecordError(f"{where}: output_logprobs has {arr.size} values for {n} output_ids")
    if arr.size and not np.all(np.isfinite(arr)):
        raise RecordError(f"{where}: output_logprobs holds NaN or infinite values")
    if arr.size and arr.max() > 0.0:
        raise RecordError(f"{where}: output_logprobs holds a value > 0 ({float(arr.max())})")
    return _read_only(arr)


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class ModelCall:
    """One request to the inference engine, token-exact."""

    call_id: str
    """Unique within the run."""
    agent_id: str
    """The agent that made the call (the main agent, a summarizer, a subagent instance)."""
    kind: CallKind
    """``main`` | ``summary`` | ``subagent``."""
    input_ids: np.ndarray
    """The full context sent to the engine, ``[n_in]`` ints (n_in >= 1)."""
    output_ids: np.ndarray
    """Exactly the tokens the engine generated, ``[n_out]`` ints."""
    output_logprobs: np.ndarray
    """Behaviour logprob of each output token, ``[n_out]`` floats <= 0."""
    policy_version: int
    """Number of optimizer steps applied to the weights that generated the output."""
    parent_agent_id: str | None = None
    """The agent that spawned this one (required for ``subagent``; optional for ``summary``)."""
    start_time: float = 0.0
    """Wall-clock seconds when the request was sent (informational)."""
    end_time: float = 0.0
    """Wall-clock seconds when the response arrived (informational)."""
    run_id: str | None = None
    """The run this call belongs to, when known (used in error messages)."""

    def __post_init__(self) -> None:
        _check_call(self, scan_inputs=True, vocab_size=None)

    @property
    def context_len(self) -> int:
        """Tokens in the context after this call: ``len(input_ids) + len(output_ids)``."""
        return int(self.input_ids.size + self.output_ids.size)

    def __repr__(self) -> str:
        return (f"ModelCall({self.call_id!r}, agent={self.agent_id!r}, kind={self.kind}, "
                f"in={self.input_ids.size}, out={self.output_ids.size}, v={self.policy_version})")


def _check_call(call: ModelCall, *, scan_inputs: bool, vocab_size: int | None) -> None:
    """Validate (and normalize in place) every field of ``call``; see the module docstring."""
    where = _where(call.run_id, call.call_id)
    for name in ("call_id", "agent_id"):
        value = getattr(call, name)
        if not isinstance(value, str) or not value:
            raise RecordError(f"{where}: {name} must be a non-empty string, got {value!r}")
    if call.kind not in CALL_KINDS:
        raise RecordError(f"{where}: kind {call.kind!r} is not one of {CALL_KINDS}")
    if call.kind == "subagent" and not call.parent_agent_id:
        raise RecordError(f"{where}: parent_agent_id is required for a subagent call")
    if call.parent_agent_id is not None and call.parent_agent_id == call.agent_id:
        raise RecordError(f"{where}: parent_agent_id equals agent_id {call.agent_id!r}")
    version = call.policy_version
    if isinstance(version, bool) or not isinstance(version, (int, np.integer)) or version < 0:
        raise RecordError(f"{where}: policy_version must be an int >= 0, got {version!r}")
    inp = as_token_array(call.input_ids, field="input_ids", where=where, allow_empty=False,
                         scan=scan_inputs, vocab_size=vocab_size)
    out = as_token_array(call.output_ids, field="output_ids", where=where, allow_empty=True,
                         vocab_size=vocab_size)
    lps = as_logprobs(call.output_logprobs, n=out.size, where=where)
    for name in ("start_time", "end_time"):
        value = getattr(call, name)
        if isinstance(value, bool) or not isinstance(value, (int, float, np.integer,
                                                             np.floating)) \
                or not math.isfinite(value):
            raise RecordError(f"{where}: {name} must be a finite number, got {value!r}")
    object.__setattr__(call, "input_ids", inp)
    object.__setattr__(call, "output_ids", out)
    object.__setattr__(call, "output_logprobs", lps)
    object.__setattr__(call, "policy_version", int(version))


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class AgentRun:
    """One agent attempt at one task: its calls, in order, and how it ended."""

    run_id: str
    """Unique within a batch."""
    group_id: str
    """The group (task × step) the run belongs to; advantages are computed per group."""
    calls: Sequence[ModelCall]
    """The run's model calls in the order they were issued (stored as a tuple)."""
    reward: float
    """The task's score of the final (or, for a timeout, partial) state. Finite."""
    status: RunStatus
    """``finished`` | ``timeout`` (scored partial work, trained) | ``failed`` (not trained)."""

    def __post_init__(self) -> None:
        where = _where(self.run_id if isinstance(self.run_id, str) else None, None)
        for name in ("run_id", "group_id"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise RecordError(f"{where}: {name} must be a non-empty string, got {value!r}")
        if self.status not in RUN_STATUSES:
            raise RecordError(f"{where}: status {self.status!r} is not one of {RUN_STATUSES}")
        reward = self.reward
        if isinstance(reward, bool) or not isinstance(reward, (int, float, np.floating,
                                                               np.integer)):
            raise RecordError(f"{where}: reward must be a number, got {reward!r}")
        if not math.isfinite(float(reward)):
            raise RecordError(f"{where}: reward must be finite, got {reward!r}")
        object.__setattr__(self, "reward", float(reward))
        calls = tuple(self.calls)
        object.__setattr__(self, "calls", calls)
        _check_calls(calls, where)

    @property
    def num_tokens(self) -> int:
        """Σ over calls of output tokens (the tokens the model generated in this run)."""
        return int(sum(c.output_ids.size for c in self.calls))

    def __repr__(self) -> str:
        return (f"AgentRun({self.run_id!r}, group={self.group_id!r}, calls={len(self.calls)}, "
                f"reward={self.reward:g}, status={self.status})")


def _check_calls(calls: tuple[ModelCall, ...], where: str) -> None:
    """Run-level consistency: unique call ids, known parents, one parent per agent and kind."""
    seen_calls: set[str] = set()
    parents: dict[tuple[str, str], str | None] = {}
    for i, call in enumerate(calls):
        if not isinstance(call, ModelCall):
            raise RecordError(f"{where}: calls[{i}] is a {type(call).__name__}, not a ModelCall")
        if call.call_id in seen_calls:
            raise RecordError(f"{where}: call_id {call.call_id!r} is duplicated")
        seen_calls.add(call.call_id)
        key = (call.agent_id, call.kind)
        known = parents.setdefault(key, call.parent_agent_id)
        if known != call.parent_agent_id:
            raise RecordError(
                f"{where}, call {call.call_id!r}: parent_agent_id {call.parent_agent_id!r} "
                f"differs from {known!r}, given by earlier {call.kind} calls of agent "
                f"{call.agent_id!r}")
    agents = {agent for agent, _ in parents}
    for call in calls:
        parent = call.parent_agent_id
        if parent is not None and parent not in agents:
            raise RecordError(f"{where}, call {call.call_id!r}: parent_agent_id {parent!r} "
                              f"names no agent of this run")


def check_run(run: object, *, vocab_size: int | None = None, scan_inputs: bool = True) -> None:
    """Validate a run again, every call and every field, as at construction.

    Records are checked when built, but a run can reach a consumer without that check: unpickled
    from another process (``__post_init__`` does not run), or with a field overwritten through
    ``object.__setattr__``. Consumers that train on runs (the trajectory processor) call this.

    Args:
        run: the run to check (anything: a non-``AgentRun`` is an error).
        vocab_size: when given, every id must be ``< vocab_size``.
        scan_inputs: whether to scan the values of every call's ``input_ids`` (O(Σ inputs));
            False checks their type, dtype and shape only (a caller that scans the assembled
            trajectories instead, which hold every input id, passes False).

    Raises:
        RecordError: naming the run, the call and the field (a missing field included).
    """
    if not isinstance(run, AgentRun):
        raise RecordError(f"record: expected an AgentRun, got {type(run).__name__}")
    try:
        run_id = run.run_id
        where = _where(run_id if isinstance(run_id, str) else None, None)
        run.__post_init__()
        for i, call in enumerate(run.calls):
            try:
                _check_call(call, scan_inputs=scan_inputs, vocab_size=vocab_size)
            except RecordError as exc:
                raise RecordError(f"{where}, calls[{i}]: {exc}") from None
            except AttributeError as exc:
                raise RecordError(f"{where}, calls[{i}]: a field is missing ({exc})") from None
    except AttributeError as exc:
        raise RecordError(f"record: a field of the run is missing ({exc})") from None
