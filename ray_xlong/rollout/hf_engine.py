"""HF transformers backend: continuous batching with a KV cache on CPU (small models, fast tests).

The live requests are one left-padded batch decoded step by step with one ``DynamicCache``::

    row 0   pad pad  t0 t1 t2 | o0 o1 o2 <end>          position ids 0 1 2 | 3 4 5 6
    row 1    t0  t1  t2 t3 t4 | o0 <end>                 position ids 0..4  | 5 6 (done)

Each step first decodes the running rows by one token, then prefills the requests that arrived
(their own forward over their prompts, a fresh cache) and joins them to the batch: both caches
and masks are left-padded to one length and concatenated along the batch. A finished row leaves
at once (its answer goes out that step) and the columns no remaining row attends to are cut
from the left, so the batch is as long as its longest live row. Padding is masked out and each
row has its own position ids, so a row's logits do not depend on its neighbours (up to float
rounding). Models whose cache is not plain full attention (sliding-window layers) run whole
batches instead (``joins_running_batch`` is False).

Each row samples with its own seeded ``torch.Generator`` (temperature; 0 = greedy) and records
the logprob of the sampled id under the raw logits (``log_softmax`` in float32, T = 1), the
same quantity vLLM reports. A row stops at a stop id (kept in its output) or ``max_tokens``.
No prefix cache: ``num_cached_tokens`` is always 0.

``sleep`` keeps a CPU copy of the current weights and drops the model object (its memory goes
back to the process); ``wake_up`` reloads the directory and applies the kept weights, so the
policy version survives a sleep.
"""

from __future__ import annotations

import dataclasses
import pathlib
from typing import Mapping, Sequence

import numpy as np
import torch

from ray_xlong.rollout.batching import BatchingEngine, StepResult
from ray_xlong.rollout.engine import SamplingConfig


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
        self._batch: _Batch | None = None
        self.joins_running_batch = _full_attention_cache(self.model)
        super().__init__(vocab_size=int(self.model.config.vocab_size),
                         max_batch_size=max_batch_size, seed=seed)

    # -- hooks ------------------------------------------------------------------------------
    def _load_weights(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        unexpected = set(state_dict) - set(self.model.state_dict())
        if unexpected:        # checked first: a refused update leaves the weights untouched
            raise ValueError(f"update_weights: unknown parameter names {sorted(unexpected)[:5]}")
        self.model.load_state_dict(dict(state_dict), strict=False)
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
    def _step(self, new: Sequence[tuple[int, np.ndarray, SamplingConfig, int]],
              drop: Sequence[int]) -> list[tuple[int, StepResult]]:
        batch = self._batch
        if batch is not None and drop:
            gone = set(drop)
            batch = batch.keep([row.key not in gone for row in batch.rows])
        if batch is not None:
            batch.decode(self.model)
        if new:
            joined = _Batch.prefill(self.model, new, trim=self.joins_running_batch)
            batch = joined if batch is None else batch.join(joined)
        finished = [row for row in batch.rows if row.reason is not None] if batch else []
        if finished:
            batch = batch.keep([row.reason is None for row in batch.rows])
        self._batch = batch
        return [(row.key, (np.asarray(row.out, np.int64), np.asarray(row.logprobs, np.float64),
                           row.reason, 0)) for row in finished]

    def _abort_all(self) -> None:
        self._batch = None


@dataclasses.dataclass(slots=True, eq=False)
class _Row:
    """One live request: its sampling, generator and what it generated so far."""

    key: int
    sampling: SamplingConfig
    gen: torch.Generator
    out: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    reason: str | None = None

    def take(self, tok: int, logprob: float) -> None:
        self.out.append(tok)
        self.logprobs.append(logprob)
        if tok in self.sampling.stop_token_ids:
            self.reason = "stop"
        elif len(self.out) >= self.sampling.max_tokens:
            self.reason = "length"


@dataclasses.dataclass(slots=True, eq=False)
class _Batch:
    """The live rows: KV cache, ``[B, L]`` attention mask, ``[B, 1]`` position ids of the next
    input and ``[B]`` last sampled ids (the next input)."""

    rows: list[_Row]
    cache: object
    mask: torch.Tensor
    positions: torch.Tensor
    last: torch.Tensor
    trim: bool
    """Whether columns no row attends to may be cut (full-attention caches only: a sliding
    window layer keeps its own length bookkeeping)."""

    @classmethod
    def prefill(cls, model, new, *, trim: bool) -> "_Batch":
        """Run the new requests' prompts; each row samples its first id."""
        from transformers import DynamicCache

        ids, mask, positions = _left_pad([inp for _, inp, _, _ in new])
        cache = DynamicCache(config=model.config)
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions,
                       past_key_values=cache, use_cache=True).logits[:, -1, :]
        rows = [_Row(key, sampling, torch.Generator().manual_seed(seed))
                for key, _, sampling, seed in new]
        return cls(rows, cache, mask, positions[:, -1:] + 1, _sample(logits, rows), trim)

    def decode(self, model) -> None:
        """Every row one id further."""
        self.mask = torch.cat([self.mask, torch.ones_like(self.mask[:, :1])], dim=1)
        logits = model(input_ids=self.last[:, None], attention_mask=self.mask,
                       position_ids=self.positions, past_key_values=self.cache,
                       use_cache=True).logits[:, -1, :]
        self.positions = self.positions + 1
        self.last = _sample(logits, self.rows)

    def join(self, other: "_Batch") -> "_Batch":
        """Both batches as one: caches and masks left-padded to one length, then stacked."""
        length = max(self.mask.shape[1], other.mask.shape[1])
        pad = lambda t, dim: _pad_left(t, length, dim)                     # noqa: E731
        for mine, theirs in zip(self.cache.layers, other.cache.layers):
            mine.keys = torch.cat([pad(mine.keys, -2), pad(theirs.keys, -2)])
            mine.values = torch.cat([pad(mine.values, -2), pad(theirs.values, -2)])
        return _Batch(self.rows + other.rows, self.cache,
                      torch.cat([pad(self.mask, 1), pad(other.mask, 1)]),
                      torch.cat([self.positions, other.positions]),
                      torch.cat([self.last, other.last]), self.trim)

    def keep(self, which: list[bool]) -> "_Batch | None":
        """Only the rows where ``which`` is true (None when none is), cut to the columns they
        attend to."""
        if all(which):
            return self
        index = torch.tensor([i for i, k in enumerate(which) if k], dtype=torch.long)
        if index.numel() == 0:
            return None
        self.cache.batch_select_indices(index)
        mask = self.mask[index]
        lead = int(mask.any(dim=0).to(torch.int8).argmax())     # first column any row uses
        if lead and self.trim:
            mask = mask[:, lead:]
            for layer in self.cache.layers:
                layer.keys, layer.values = layer.keys[:, :, lead:], layer.values[:, :, lead:]
        return _Batch([self.rows[i] for i in index.tolist()], self.cache, mask,
                      self.positions[index], self.last[index], self.trim)


def _full_attention_cache(model) -> bool:
    """Whether the model's cache is plain full attention on every layer (batches can join)."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    return all(type(layer) is DynamicLayer for layer in DynamicCache(config=model.config).layers)


def _sample(logits: torch.Tensor, rows: list[_Row]) -> torch.Tensor:
    """Each row samples one id (its temperature and generator) and takes it with its raw
    logprob. Returns the ``[B]`` ids."""
    logits = logits.float()
    logp = torch.log_softmax(logits, dim=-1)
    next_ids = torch.zeros(logits.shape[0], dtype=torch.long)
    for i, row in enumerate(rows):
        if row.sampling.temperature == 0:
            tok = int(torch.argmax(logits[i]))
        else:
            probs = torch.softmax(logits[i] / row.sampling.temperature, dim=-1)
            tok = int(torch.multinomial(probs, 1, generator=row.gen))
        next_ids[i] = tok
        row.take(tok, float(logp[i, tok]))
    return next_ids


def _pad_left(t: torch.Tensor, length: int, dim: int) -> torch.Tensor:
    """``t`` zero-padded at the front of ``dim`` to ``length``."""
    missing = length - t.shape[dim]
    if missing == 0:
        return t
    shape = list(t.shape)
    shape[dim] = missing
    return torch.cat([t.new_zeros(shape), t], dim=dim)


def _left_pad(prompts: Sequence[np.ndarray]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``[B, L]`` left-padded ids, attention mask and position ids (0 at each first token)."""
    longest = max(p.size for p in prompts)
    ids = torch.zeros(len(prompts), longest, dtype=torch.long)
    mask = torch.zeros(len(prompts), longest, dtype=torch.long)
    for row, inp in enumerate(prompts):
        ids[row, longest - inp.size:] = torch.from_numpy(inp)
        mask[row, longest - inp.size:] = 1
    positions = (mask.cumsum(dim=1) - 1).clamp(min=0)
    return ids, mask, positions
