"""Target logprobs through the output head in chunks: memory O(chunk × V), not O(T × V).

``token_logprobs`` runs the model's own forward with a pre-hook on the output embedding that
gathers the hidden states at the targets. Materialising the head on all ``T`` targets at once
costs ``T × V`` floats (200k targets × a 151k vocabulary: ~120 GB in fp32, then a log-softmax
copy). Here the hook keeps the ``[T, H]`` hidden states and lets the model's forward run its
head and logit post-processing on a *probe* of a few targets only; the logprobs are then
computed chunk by chunk, and recomputed chunk by chunk in backward::

    forward   per chunk c:  z = post(h_c Wᵀ + b) / temperature      [chunk, V] float32
                            logp_c = z[target] − logsumexp(z)        keep logp_c only
    backward  per chunk c:  recompute z;  dz = g·(onehot − softmax z)
                            dz_raw = post'(dz);  dh_c = dz_raw W;  dW += dz_rawᵀ h_c

``post`` is the model's own logit post-processing, read off the probe: the model's forward
output on the probe targets is compared with the candidates its config names (identity, a
multiplier or divisor from ``logit_scale`` / ``logits_scaling``, Gemma's
``final_logit_softcapping``); the one that reproduces the model's logits is used, and a model
whose post-processing is none of them is refused by name (``LogitPostUnsupported``; pass
``chunk_tokens=0`` for the unchunked path). Low-precision heads compute ``h Wᵀ`` in their dtype
and upcast the logits, as the unchunked path does.
"""

from __future__ import annotations

import dataclasses

import torch

CHUNK_BYTES = 256 * 2 ** 20
"""Float32 logits per chunk by default (rows = CHUNK_BYTES ÷ (4 · V), at least 1)."""
PROBE = 4
"""Targets the model's own head runs on (to read its logit post-processing)."""


class LogitPostUnsupported(ValueError):
    """The model's logit post-processing is not one the chunked head can reproduce."""


@dataclasses.dataclass(frozen=True, slots=True)
class LogitPost:
    """``z = softcap · tanh(scale · raw / softcap)`` (no tanh when ``softcap`` is None)."""

    scale: float = 1.0
    """Multiplier of the raw head output (Cohere ``logit_scale``, Granite ``1 / logits_scaling``)."""
    softcap: float | None = None
    """Final logit soft-capping (Gemma-2/3), applied after ``scale``."""

    def apply(self, raw: torch.Tensor) -> torch.Tensor:
        """Post-processed logits."""
        z = raw * self.scale if self.scale != 1.0 else raw
        return torch.tanh(z / self.softcap) * self.softcap if self.softcap else z

    def grad(self, dz: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """``∂/∂raw`` from ``∂/∂z`` (``z``: the post-processed logits)."""
        if self.softcap:
            dz = dz * (1.0 - (z / self.softcap) ** 2)
        return dz * self.scale if self.scale != 1.0 else dz


def candidates(config) -> list[LogitPost]:
    """The post-processing forms ``config`` names (identity first)."""
    scales = {1.0}
    for name in ("logit_scale", "logits_scaling"):
        value = getattr(config, name, None) or getattr(getattr(config, "text_config", None),
                                                       name, None)
        if value:
            scales |= {float(value), 1.0 / float(value)}
    caps = [None]
    cap = getattr(config, "final_logit_softcapping", None)
    if cap:
        caps.append(float(cap))
    return [LogitPost(s, c) for c in caps for s in sorted(scales, key=lambda s: s != 1.0)]


def read_post(model: torch.nn.Module, raw: torch.Tensor, logits: torch.Tensor) -> LogitPost:
    """The candidate mapping the probe's raw head output ``raw`` to the model's ``logits``."""
    want = logits.detach().double()
    tol = 1e-6 if raw.dtype == torch.float64 else (1e-4 if raw.dtype == torch.float32 else 2e-2)
    for post in candidates(model.config):
        got = post.apply(raw.detach().double())
        if torch.allclose(got, want, rtol=tol, atol=tol * max(1.0, float(want.abs().max()))):
            return post
    raise LogitPostUnsupported(
        f"{type(model).__name__}: its logits are not its output head's under any post-processing "
        f"its config names (logit_scale / logits_scaling / final_logit_softcapping); pass "
        f"chunk_tokens=0 to token_logprobs for the unchunked head")


def chunk_rows(vocab: int, chunk_tokens: int | None) -> int:
    """Targets per chunk: ``chunk_tokens``, or :data:`CHUNK_BYTES` of float32 logits."""
    return chunk_tokens if chunk_tokens else max(1, CHUNK_BYTES // (4 * vocab))


def _logits(h, weight, bias, post: LogitPost, temperature: float):
    raw = torch.nn.functional.linear(h, weight, bias)
    if raw.dtype in (torch.float16, torch.bfloat16):
        raw = raw.float()
    z = post.apply(raw)
    return z / temperature if temperature != 1.0 else z


class _ChunkedHead(torch.autograd.Function):
    """``[T]`` target logprobs, head recomputed per chunk in backward (see module docstring)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, post, temperature, rows):
        out = []
        for lo in range(0, hidden.shape[0], rows):
            z = _logits(hidden[lo:lo + rows], weight, bias, post, temperature)
            t = targets[lo:lo + rows].unsqueeze(-1)
            out.append((z.gather(-1, t) - torch.logsumexp(z, dim=-1, keepdim=True)).squeeze(-1))
        ctx.save_for_backward(hidden, weight, bias, targets)
        ctx.post, ctx.temperature, ctx.rows = post, temperature, rows
        return torch.cat(out) if out else hidden.new_zeros(0, dtype=torch.float32)

    @staticmethod
    def backward(ctx, grad):
        hidden, weight, bias, targets = ctx.saved_tensors
        post, temperature, rows = ctx.post, ctx.temperature, ctx.rows
        acc = torch.float64 if weight.dtype == torch.float64 else torch.float32
        dh = torch.empty_like(hidden)
        dw = torch.zeros(weight.shape, dtype=acc, device=weight.device)
        db = None if bias is None else torch.zeros(bias.shape, dtype=acc, device=bias.device)
        for lo in range(0, hidden.shape[0], rows):
            h, g = hidden[lo:lo + rows], grad[lo:lo + rows].unsqueeze(-1)
            z = _logits(h, weight, bias, post, temperature)
            dz = torch.softmax(z, dim=-1).mul_(-g)
            dz.scatter_add_(-1, targets[lo:lo + rows].unsqueeze(-1), g.to(dz.dtype))
            if temperature != 1.0:
                dz = dz / temperature
            draw = post.grad(dz, z * temperature if temperature != 1.0 else z)
            dh[lo:lo + rows] = (draw.to(weight.dtype) @ weight).to(dh.dtype)
            dw += draw.to(acc).T @ h.to(acc)
            if db is not None:
                db += draw.to(acc).sum(0)
        return (dh, dw.to(weight.dtype), None if db is None else db.to(bias.dtype), None, None,
                None, None)


def chunked_logprobs(hidden: torch.Tensor, head: torch.nn.Linear, targets: torch.Tensor, *,
                     post: LogitPost = LogitPost(), temperature: float = 1.0,
                     chunk_tokens: int | None = None) -> torch.Tensor:
    """Logprobs of ``targets`` under ``post(head(hidden)) / temperature``, chunked.

    Args:
        hidden: ``[T, H]`` hidden states at the targets' sources.
        head: the output embedding (``nn.Linear``; its bias, if any, is used).
        targets: ``[T]`` int64 token ids.
        post: the model's logit post-processing (:func:`read_post`).
        temperature: the sampling temperature (after ``post``).
        chunk_tokens: targets per chunk (None: :func:`chunk_rows`).

    Returns:
        ``[T]`` float32 logprobs (float64 for a float64 head), differentiable in ``hidden``
        and the head's parameters.
    """
    rows = chunk_rows(head.weight.shape[0], chunk_tokens)
    return _ChunkedHead.apply(hidden, head.weight, head.bias, targets, post, float(temperature),
                              rows)


def probe_size(num_targets: int) -> int:
    """Targets the model's own head runs on (``min(T, PROBE)``)."""
    return min(num_targets, PROBE)


def is_chunkable(model: torch.nn.Module) -> bool:
    """Whether the output embedding is a plain ``nn.Linear`` (what the chunked head computes)."""
    head = model.get_output_embeddings()
    return isinstance(head, torch.nn.Linear)
