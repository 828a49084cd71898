"""HF transformers backend: batched sampling with a KV cache on CPU (small models, fast tests).

A batch of requests is left-padded into one ``[B, L]`` tensor and decoded step by step with one
``DynamicCache``::

    row 0   pad pad  t0 t1 t2 | o0 o1 o2 <end>          position ids 0 1 2 | 3 4 5 6
    row 1    t0  t1  t2 t3 t4 | o0 <end> .  .           position ids 0..4  | 5 6 (done)

Each row samples with its own seeded ``torch.Generator`` (temperature; 0 = greedy) and records
the logprob of the sampled id under the raw logits (``log_softmax`` in float32, T = 1), the
same quantity vLLM reports. A row stops at a stop id (kept in its output) or ``max_tokens``.
No prefix cache: ``num_cached_tokens`` is always 0.

``sleep`` keeps a CPU copy of the current weights and drops the model object (its memory goes
back to the process); ``wake_up`` reloads the directory and applies the kept weights, so the
policy version survives a sleep.
"""

from __future__ import annotations

import pathlib
from typing import Mapping, Sequence

import numpy as np
import torch

from ray_xlong.rollout.engine import BatchingEngine, SamplingConfig


class HFEngine(BatchingEngine):
    """HF transformers engine over a model directory (see module docstring)."""

    def __init__(self, model_dir: str | pathlib.Path, *, max_batch_size: int = 16,
                 seed: int = 0, dtype: torch.dtype = torch.float32,
                 model: torch.nn.Module | None = None) -> None:
        """Args:
            model_dir: a directory written by ``ray_xlong.models.build_tiny_model_dir``.
            max_batch_size: most requests per batch.
            seed: seeds per-request sampling when a request gives no seed.
            dtype: compute dtype.
            model: an already loaded model of that directory (skips loading).
        """
        from ray_xlong.models.build import load_model

        self.model_dir = pathlib.Path(model_dir)
        self.dtype = dtype
        self.model = model if model is not None else load_model(model_dir, dtype=dtype)
        self._saved: dict[str, torch.Tensor] | None = None
        super().__init__(vocab_size=int(self.model.config.vocab_size),
                         max_batch_size=max_batch_size, seed=seed)

    # -- hooks ------------------------------------------------------------------------------
    def _load_weights(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        missing, unexpected = self.model.load_state_dict(dict(state_dict), strict=False)
        if unexpected:
            raise ValueError(f"update_weights: unknown parameter names {sorted(unexpected)[:5]}")
        self.model.eval()

    def _stash_weights(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        self._saved = {k: v.detach().clone() for k, v in state_dict.items()}

    def _release(self) -> None:
        self._saved = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        self.model = None

    def _restore(self) -> None:
        from ray_xlong.models.build import load_model

        self.model = load_model(self.model_dir, dtype=self.dtype)
        if self._saved is not None:
            self._load_weights(self._saved)
            self._saved = None

    @torch.no_grad()
    def _run_batch(self, requests: Sequence[tuple[np.ndarray, SamplingConfig, int]]
                   ) -> list[tuple[np.ndarray, np.ndarray, str, int]]:
        from transformers import DynamicCache

        ids, mask, positions = _left_pad(requests)
        gens = [torch.Generator().manual_seed(seed) for _, _, seed in requests]
        outputs: list[list[int]] = [[] for _ in requests]
        logprobs: list[list[float]] = [[] for _ in requests]
        reasons: list[str | None] = [None] * len(requests)
        cache = DynamicCache(config=self.model.config)
        step_ids = ids
        for _ in range(max(s.max_tokens for _, s, _ in requests)):
            logits = self.model(input_ids=step_ids, attention_mask=mask, position_ids=positions,
                                past_key_values=cache, use_cache=True).logits[:, -1, :]
            next_ids = self._sample_step(logits.float(), requests, gens, outputs, logprobs,
                                         reasons)
            if all(r is not None for r in reasons):
                break
            step_ids = next_ids[:, None]
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            positions = positions[:, -1:] + 1
        return [(np.asarray(o, np.int64), np.asarray(lp, np.float64), r or "length", 0)
                for o, lp, r in zip(outputs, logprobs, reasons)]

    @staticmethod
    def _sample_step(logits: torch.Tensor, requests, gens, outputs, logprobs,
                     reasons) -> torch.Tensor:
        """Sample one id per row; append to the rows still running. Returns ``[B]`` ids."""
        logp = torch.log_softmax(logits, dim=-1)
        next_ids = torch.zeros(logits.shape[0], dtype=torch.long)
        for row, (_, sampling, _) in enumerate(requests):
            if sampling.temperature == 0:
                tok = int(torch.argmax(logits[row]))
            else:
                probs = torch.softmax(logits[row] / sampling.temperature, dim=-1)
                tok = int(torch.multinomial(probs, 1, generator=gens[row]))
            next_ids[row] = tok
            if reasons[row] is not None:
                continue
            outputs[row].append(tok)
            logprobs[row].append(float(logp[row, tok]))
            if tok in sampling.stop_token_ids:
                reasons[row] = "stop"
            elif len(outputs[row]) >= sampling.max_tokens:
                reasons[row] = "length"
        return next_ids


def _left_pad(requests) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``[B, L]`` left-padded ids, attention mask and position ids (0 at each first token)."""
    longest = max(r[0].size for r in requests)
    ids = torch.zeros(len(requests), longest, dtype=torch.long)
    mask = torch.zeros(len(requests), longest, dtype=torch.long)
    for row, (inp, _, _) in enumerate(requests):
        ids[row, longest - inp.size:] = torch.from_numpy(inp)
        mask[row, longest - inp.size:] = 1
    positions = (mask.cumsum(dim=1) - 1).clamp(min=0)
    return ids, mask, positions
