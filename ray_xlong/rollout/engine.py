"""The inference engine interface: what every backend answers, and with what.

An engine takes token ids, never text, and answers with exactly the ids it generated, one
behaviour logprob per id and the policy version of the weights that produced them::

    await engine.generate(input_ids, sampling=SamplingConfig(max_tokens=64, stop_token_ids=(9,)))
        -> GenerateResult(output_ids [m], output_logprobs [m], policy_version, finish_reason, ...)
    await engine.update_weights(state_dict, version=v)    applied between batches
    await engine.sleep() / await engine.wake_up()         lend / take back the engine's memory

The loop both backends share is :class:`~ray_xlong.rollout.batching.BatchingEngine`
(``batching.py``).
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Protocol

import numpy as np
import torch

from ray_xlong.checks import check_int
from ray_xlong.trajectory.records import id_range


class EngineError(RuntimeError):
    """A request could not be served (backend failure, closed engine). Retrying may succeed."""


@dataclasses.dataclass(frozen=True, slots=True)
class SamplingConfig:
    """How one request is sampled."""

    max_tokens: int = 64
    """Most tokens to generate (>= 1)."""
    temperature: float = 1.0
    """Softmax temperature; 0 means greedy. Logprobs are always of the raw (T = 1) model."""
    stop_token_ids: tuple[int, ...] = ()
    """Generation stops after emitting one of these (the stop id is part of the output)."""
    seed: int | None = None
    """Per-request sampling seed (None: drawn from the engine's seeded generator)."""

    def __post_init__(self) -> None:
        check_int("SamplingConfig", "max_tokens", self.max_tokens, minimum=1)
        if not isinstance(self.temperature, (int, float)) or not self.temperature >= 0:
            raise ValueError(f"SamplingConfig.temperature must be >= 0, got {self.temperature!r}")
        if not all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids):
            raise ValueError(f"SamplingConfig.stop_token_ids must be ints >= 0, "
                             f"got {self.stop_token_ids!r}")


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class GenerateResult:
    """The engine's answer to one request."""

    output_ids: np.ndarray
    """``[m]`` int64: exactly the generated ids (a stop id included)."""
    output_logprobs: np.ndarray
    """``[m]`` float64: logprob of each output id under the generating weights."""
    policy_version: int
    """Version of the weights that generated every output id."""
    finish_reason: str
    """``stop`` (a stop id was generated) | ``length`` (``max_tokens`` reached)."""
    num_cached_tokens: int = 0
    """Input tokens served from the prefix cache (0 for backends without one)."""


@dataclasses.dataclass(frozen=True, slots=True)
class EngineStats:
    """Counters since the engine was built."""

    requests: int
    """Requests answered."""
    batches: int
    """Batches started: groups of requests admitted together (a continuous backend admits
    requests into a running batch, each admission counts)."""
    prompt_tokens: int
    """Σ input tokens of answered requests."""
    output_tokens: int
    """Σ generated tokens."""
    cached_tokens: int
    """Σ input tokens served from the prefix cache."""
    busy_s: float
    """Seconds spent generating."""
    weight_updates: int
    """Weight updates applied."""

    @property
    def prefix_hit_rate(self) -> float:
        """``cached_tokens / prompt_tokens`` (0 when nothing was asked)."""
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


class Engine(Protocol):
    """What the harness and the env runner need from an inference engine."""

    @property
    def policy_version(self) -> int:
        """Version of the weights the next batch will use."""

    @property
    def vocab_size(self) -> int:
        """Ids the engine accepts and generates: ``[0, vocab_size)``."""

    async def generate(self, input_ids: np.ndarray, *,
                       sampling: SamplingConfig) -> GenerateResult:
        """Generate from ``input_ids`` (``[n]`` ints, n >= 1)."""

    async def update_weights(self, state_dict: Mapping[str, torch.Tensor], *,
                             version: int) -> None:
        """Load new weights between batches; returns once applied."""

    async def sleep(self) -> None:
        """Finish the requests in flight, then release the engine's memory."""

    async def wake_up(self) -> None:
        """Restore the engine (with its latest weights) and serve waiting requests."""

    def stats(self) -> EngineStats:
        """Counters (see :class:`EngineStats`)."""

    async def close(self) -> None:
        """Stop serving; pending requests fail with :class:`EngineError`."""


def check_input_ids(input_ids: object, *, vocab_size: int) -> np.ndarray:
    """``input_ids`` as a 1-D int64 array in ``[0, vocab_size)``; raises ValueError otherwise."""
    arr = np.asarray(input_ids)
    if arr.ndim != 1 or arr.size == 0 or arr.dtype.kind not in "iu":
        raise ValueError(f"input_ids must be a non-empty 1-D integer array, got "
                         f"shape {arr.shape} dtype {arr.dtype}")
    lo, hi = id_range(arr)        # a context's prefix view: only its new ids are scanned
    if lo < 0 or hi >= vocab_size:
        raise ValueError(f"input_ids must lie in [0, {vocab_size}), got [{lo}, {hi}]")
    return arr.astype(np.int64, copy=False)
