"""A scripted engine: outputs chosen by a policy callable, logprobs from a real model.

``ScriptedEngine(policy, model=...)`` is a :class:`BatchingEngine` (same batching, weight
updates between batches, versions, sleep) whose ``_run_batch`` asks ``policy(input_ids) ->
output_ids`` instead of sampling. Used where the branching of a run must be known (integration
tests of the harness and the trajectory processor) and by the scheduler benchmarks, which need
runs that finish long-horizon tasks without a trained model.

Policy contract (``ScriptedPolicy``): a plain callable taking the exact context ids (``[n]``
int64, read-only) and returning the ids to emit; the engine cuts them at the first stop id or
``max_tokens`` like a real engine. It may raise: the batch then fails with ``EngineError``.

Logprobs: with ``model`` given, the model's log-softmax of each emitted id (teacher forcing,
one forward pass per request), so the records are what that model would report; without,
``-1.0`` per token.
"""

from __future__ import annotations

from typing import Callable, Mapping, Sequence

import numpy as np
import torch

from ray_xlong.rollout.batching import BatchingEngine
from ray_xlong.rollout.engine import SamplingConfig

ScriptedPolicy = Callable[[np.ndarray], np.ndarray]
"""``policy(input_ids [n]) -> output_ids [m]``."""


class ScriptedEngine(BatchingEngine):
    """An engine driven by a policy callable (see module docstring)."""

    def __init__(self, policy: ScriptedPolicy, *, vocab_size: int,
                 model: torch.nn.Module | None = None, max_batch_size: int = 64,
                 seed: int = 0) -> None:
        self.policy = policy
        self.model = model
        super().__init__(vocab_size=vocab_size, max_batch_size=max_batch_size, seed=seed)

    def _run_batch(self, requests: Sequence[tuple[np.ndarray, SamplingConfig, int]]
                   ) -> list[tuple[np.ndarray, np.ndarray, str, int]]:
        results = []
        for ids, sampling, _ in requests:
            view = ids.view()
            view.flags.writeable = False
            out = np.asarray(self.policy(view), np.int64)[:sampling.max_tokens]
            stops = np.flatnonzero(np.isin(out, sampling.stop_token_ids))
            reason = "length"
            if stops.size:
                out, reason = out[:stops[0] + 1], "stop"
            if out.size and (out.min() < 0 or out.max() >= self.vocab_size):
                raise ValueError(f"scripted policy emitted ids outside [0, {self.vocab_size})")
            results.append((out, self._logprobs(ids, out), reason, 0))
        return results

    @torch.no_grad()
    def _logprobs(self, ids: np.ndarray, out: np.ndarray) -> np.ndarray:
        if self.model is None or out.size == 0:
            return np.full(out.size, -1.0)
        full = torch.from_numpy(np.concatenate([ids, out]))[None]
        logits = self.model(input_ids=full).logits[0, ids.size - 1:-1].float()
        lp = torch.log_softmax(logits, -1).gather(-1, torch.from_numpy(out)[:, None])[:, 0]
        return lp.double().numpy()

    def _load_weights(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        if self.model is not None:
            self.model.load_state_dict(dict(state_dict), strict=False)

    def _release(self) -> None:
        pass

    def _restore(self) -> None:
        pass
