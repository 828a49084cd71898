"""Per-target logprobs of a HF causal LM on a :class:`PackedBatch`, in either layout.

The tree layout needs a custom attention mask (ancestor-or-self, from ``kv_end``) and
``position_ids`` = depth; HF models accept an already-built 4D mask as-is. Which tensor to build
depends on the attention implementation:

* ``eager``: an additive *float* mask (0 / dtype min). A bool 4D mask is silently wrong under
  eager (it would be *added* as 0/1), so it is never passed there.
* ``sdpa``: a bool mask (True = attend).
* ``flex_attention`` (GPU): a ``BlockMask`` built from the same ``kv_end`` rule.
* ``xlong_tree`` (``tree_attention.py``, any device): no mask at all; a plan of segments makes
  attention skip the pairs a dense mask would compute and hide (the CPU training path).

Logits are computed only at source positions: the decoder's hidden states are gathered at
``target_src`` before the output projection, so memory is ``T × V``, not ``R × L × V``.
"""

from __future__ import annotations

import torch

from ray_xlong.trajectory.packing import PackedBatch
from ray_xlong.trajectory.tree_attention import ATTN_IMPLEMENTATION, tree_plan


def tree_mask_bool(kv_end: torch.Tensor) -> torch.Tensor:
    """``[R, 1, L, L]`` bool mask, True where query ``i`` may attend key ``j``: ``j <= i < kv_end[j]``.

    Args:
        kv_end: ``[R, L]`` int64 (``PackedBatch.attention_mask`` of a tree batch).
    """
    cols = torch.arange(kv_end.shape[1], device=kv_end.device)
    q = cols.view(1, -1, 1)
    k = cols.view(1, 1, -1)
    return ((k <= q) & (q < kv_end.unsqueeze(1))).unsqueeze(1)


def tree_mask(kv_end: torch.Tensor, *, attn_implementation: str, dtype: torch.dtype):
    """The 4D mask for ``attn_implementation`` (``eager`` | ``sdpa`` | ``flex_attention``)."""
    if attn_implementation == "flex_attention":
        return tree_block_mask(kv_end)
    allowed = tree_mask_bool(kv_end)
    if attn_implementation == "sdpa":
        return allowed
    if attn_implementation == "eager":
        mask = torch.zeros(allowed.shape, dtype=dtype, device=kv_end.device)
        return mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    raise ValueError(f"tree_mask: unsupported attn_implementation {attn_implementation!r}")


def tree_block_mask(kv_end: torch.Tensor):
    """A flex-attention ``BlockMask`` for the tree rule (GPU path; no dense L × L tensor)."""
    from torch.nn.attention.flex_attention import create_block_mask

    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx < kv_end[b, kv_idx])

    rows, length = kv_end.shape
    return create_block_mask(mask_mod, B=rows, H=None, Q_LEN=length, KV_LEN=length,
                             device=kv_end.device)


def attention_inputs(model: torch.nn.Module, batch: PackedBatch, *, device=None) -> dict:
    """Keyword arguments for the model's decoder: ids, mask, positions (and a tree plan)."""
    device = device or next(model.parameters()).device
    mask = batch.attention_mask.to(device)
    extra = {}
    if batch.layout == "tree":
        impl = getattr(model.config, "_attn_implementation", None) or "eager"
        if impl == ATTN_IMPLEMENTATION:
            extra["tree_plan"] = tree_plan(mask, batch.valid)
            mask = mask[:, None, None, :]          # 4D: HF passes it through untouched
        else:
            mask = tree_mask(mask, attn_implementation=impl,
                             dtype=next(model.parameters()).dtype)
    return dict(input_ids=batch.input_ids.to(device), attention_mask=mask,
                position_ids=batch.position_ids.to(device), **extra)


def token_logprobs(model: torch.nn.Module, batch: PackedBatch, *,
                   temperature: float = 1.0) -> torch.Tensor:
    """Logprob of every target under ``model`` (differentiable).

    Args:
        model: a HF causal LM (``get_decoder()`` and ``get_output_embeddings()``).
        batch: a packed batch, either layout.
        temperature: the sampling temperature the engine used (logits are divided by it).

    Returns:
        ``[T]`` logprobs, in the batch's canonical target order (the same in both layouts).
    """
    hidden = model.get_decoder()(**attention_inputs(model, batch),
                                 use_cache=False).last_hidden_state
    device = hidden.device
    picked = hidden[batch.target_row.to(device), batch.target_src.to(device)]
    logits = model.get_output_embeddings()(picked)
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    logp = torch.log_softmax(logits, dim=-1)
    return logp.gather(-1, batch.target_ids.to(device).unsqueeze(-1)).squeeze(-1)
