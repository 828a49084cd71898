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

Logits are the model's own: the whole ``model(...)`` forward runs (its head *and* its logit
post-processing: Gemma-2's final soft-capping, Cohere's ``logit_scale``, Granite's
``logits_scaling``, ...), with a pre-hook on the output embedding that gathers the hidden
states at ``target_src`` first. The head then runs in chunks of targets
(``chunked_logprobs.py``: the model's forward makes only a probe's logits, from which its
post-processing is read), so memory is O(chunk × V), not ``T × V``.

Position-dependent attention in the tree layout counts along the trajectory (position = depth):

* sliding windows (Mistral, Qwen2 ``use_sliding_window``, Gemma-2/3, Cohere-2, Starcoder2, ...):
  the dense tree mask also requires ``depth(q) - depth(k) < window``; models with per-layer
  ``layer_types`` get a ``{"full_attention": m, "sliding_attention": m_window}`` mask dict;
* ``xlong_tree`` attention reads each layer's ``sliding_window`` (and Gemma-2's ``softcap``)
  from the attention call and counts the window by depth too (``tree_attention.py``), per layer
  type for models mixing sliding and full layers; any other layer type (chunked, linear
  attention) is refused in the tree layout (:class:`TreeLayoutUnsupported`, naming the variant
  and the way out: ``pack="per_trajectory"``). The per-trajectory layout is a plain right-padded batch:
  every variant is exact there.
"""

from __future__ import annotations

import torch

from ray_xlong.trajectory.chunked_logprobs import (LogitPost, chunked_logprobs, is_chunkable,
                                                   probe_size, read_post)
from ray_xlong.trajectory.packing import PackedBatch
from ray_xlong.trajectory.split_kv import split_kv_plan
from ray_xlong.trajectory.tree_attention import (ATTN_IMPLEMENTATION, TreeLayoutUnsupported,
                                                 tree_plan)

_TREE_LAYER_TYPES = ("full_attention", "sliding_attention")


def attention_variant(config) -> tuple[tuple[str, ...], int | None]:
    """``(layer types used, sliding window)`` of a HF config (window None: no sliding layers)."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        types = tuple(dict.fromkeys(layer_types))
        return types, (window if "sliding_attention" in types else None)
    return (("sliding_attention",) if window else ("full_attention",)), window or None


def check_tree_support(model: torch.nn.Module) -> None:
    """Raise :class:`TreeLayoutUnsupported` when the tree layout cannot be exact for ``model``."""
    config = model.config
    arch = type(model).__name__
    types, _ = attention_variant(config)
    other = [t for t in types if t not in _TREE_LAYER_TYPES]
    if other:
        raise TreeLayoutUnsupported(
            f"{arch}: layer type(s) {other} are not supported in the tree layout; use "
            f"pack='per_trajectory'")


def tree_mask_bool(kv_end: torch.Tensor) -> torch.Tensor:
    """``[R, 1, L, L]`` bool mask, True where query ``i`` may attend key ``j``: ``j <= i < kv_end[j]``.

    Args:
        kv_end: ``[R, L]`` int64 (``PackedBatch.attention_mask`` of a tree batch).
    """
    cols = torch.arange(kv_end.shape[1], device=kv_end.device)
    q = cols.view(1, -1, 1)
    k = cols.view(1, 1, -1)
    return ((k <= q) & (q < kv_end.unsqueeze(1))).unsqueeze(1)


def tree_mask(kv_end: torch.Tensor, *, attn_implementation: str, dtype: torch.dtype,
              depth: torch.Tensor | None = None, window: int | None = None):
    """The 4D mask for ``attn_implementation`` (``eager`` | ``sdpa`` | ``flex_attention``);
    with ``window``, also ``depth[q] - depth[k] < window`` (``depth``: ``[R, L]`` positions)."""
    if attn_implementation == "flex_attention":
        return tree_block_mask(kv_end, depth=depth, window=window)
    allowed = tree_mask_bool(kv_end)
    if window is not None:
        allowed = allowed & ((depth.unsqueeze(2) - depth.unsqueeze(1)) < window).unsqueeze(1)
    if attn_implementation == "sdpa":
        return allowed
    if attn_implementation == "eager":
        mask = torch.zeros(allowed.shape, dtype=dtype, device=kv_end.device)
        return mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    raise ValueError(f"tree_mask: unsupported attn_implementation {attn_implementation!r}")


def tree_block_mask(kv_end: torch.Tensor, *, depth: torch.Tensor | None = None,
                    window: int | None = None):
    """A flex-attention ``BlockMask`` for the tree rule (GPU path; no dense L × L tensor)."""
    from torch.nn.attention.flex_attention import create_block_mask

    def mask_mod(b, h, q_idx, kv_idx):
        keep = (kv_idx <= q_idx) & (q_idx < kv_end[b, kv_idx])
        if window is not None:
            keep = keep & (depth[b, q_idx] - depth[b, kv_idx] < window)
        return keep

    rows, length = kv_end.shape
    return create_block_mask(mask_mod, B=rows, H=None, Q_LEN=length, KV_LEN=length,
                             device=kv_end.device)


def attention_inputs(model: torch.nn.Module, batch: PackedBatch, *, device=None,
                     plan=None) -> dict:
    """Keyword arguments for the model's decoder: ids, mask, positions (and a tree plan:
    ``plan`` when given, else one built from the batch)."""
    device = device or next(model.parameters()).device
    mask = batch.attention_mask.to(device)
    extra = {}
    if batch.layout == "tree":
        check_tree_support(model)
        impl = getattr(model.config, "_attn_implementation", None) or "eager"
        if impl == ATTN_IMPLEMENTATION:
            if plan is not None and attention_variant(model.config)[1] is not None:
                raise TreeLayoutUnsupported(
                    f"{type(model).__name__}: a context-parallel plan has no sliding windows "
                    f"(the model's window is {attention_variant(model.config)[1]}); train it "
                    f"with LearnerSettings.context_parallel=1")
            extra["tree_plan"] = plan if plan is not None else _xlong_tree_plan(
                model, mask, batch.valid, depth=batch.position_ids.to(device))
            mask = mask[:, None, None, :]          # 4D: HF passes it through untouched
        else:
            mask = _tree_masks(model, mask, batch.position_ids.to(device), impl)
    return dict(input_ids=batch.input_ids.to(device), attention_mask=mask,
                position_ids=batch.position_ids.to(device), **extra)


def _xlong_tree_plan(model: torch.nn.Module, kv_end: torch.Tensor, valid: torch.Tensor, *,
                     depth: torch.Tensor):
    """CPU: the segment plan (``tree_attention.py``); other devices: the split-KV plan over
    fused kernels (``split_kv.py``, no masks) unless attention dropout or a sliding window
    (counted along ``depth``, which the split-KV plan does not cut by) needs the segment plan."""
    dropout = float(getattr(model.config, "attention_dropout", 0.0) or 0.0)
    _, window = attention_variant(model.config)
    if kv_end.device.type == "cpu" or (model.training and dropout > 0) or window is not None:
        return tree_plan(kv_end, valid, depth=depth)
    return split_kv_plan(kv_end, valid)


def _tree_masks(model: torch.nn.Module, kv_end: torch.Tensor, depth: torch.Tensor, impl: str):
    """One tree mask, or a dict by layer type when the model has per-layer types."""
    dtype = next(model.parameters()).dtype
    types, window = attention_variant(model.config)
    masks = {t: tree_mask(kv_end, attn_implementation=impl, dtype=dtype, depth=depth,
                          window=window if t == "sliding_attention" else None) for t in types}
    if getattr(model.config, "layer_types", None):
        return masks
    return next(iter(masks.values()))


def token_logprobs(model: torch.nn.Module, batch: PackedBatch, *,
                   temperature: float = 1.0, chunk_tokens: int | None = None,
                   plan=None) -> torch.Tensor:
    """Logprob of every target under ``model`` (differentiable).

    Args:
        model: a HF causal LM (``get_output_embeddings()``; its own forward makes the logits).
        batch: a packed batch, either layout.
        temperature: the sampling temperature the engine used (logits are divided by it).
        chunk_tokens: targets per chunk of the output head (``chunked_logprobs.py``: memory
            O(chunk × V)); None: a chunk of ``CHUNK_BYTES`` float32 logits; 0: unchunked (the
            model's forward makes all ``T × V`` logits at once).
        plan: the tree plan to attend with instead of one built from ``batch`` (a
            ``context_parallel.ContextParallelPlan`` for a rank's share of a row).

    Returns:
        ``[T]`` logprobs, in the batch's canonical target order (the same in both layouts).
    """
    inputs = attention_inputs(model, batch, plan=plan)
    device = inputs["input_ids"].device
    rows, src = batch.target_row.to(device), batch.target_src.to(device)
    chunked = chunk_tokens != 0 and is_chunkable(model)
    kept = {}

    def gather(module, args):
        hidden = args[0][rows, src]
        if not chunked:
            return (hidden.unsqueeze(0),) + tuple(args[1:])
        kept["hidden"] = hidden
        return (hidden[:probe_size(len(hidden))].detach().unsqueeze(0),) + tuple(args[1:])

    handle = model.get_output_embeddings().register_forward_pre_hook(gather)
    try:
        logits = model(**inputs, use_cache=False).logits
    finally:
        handle.remove()
    expected = probe_size(rows.numel()) if chunked else rows.numel()
    if logits.shape[:2] != (1, expected):
        raise TreeLayoutUnsupported(f"{type(model).__name__}: its forward does not apply the "
                                    f"output embedding module to the hidden states (logits "
                                    f"{tuple(logits.shape)}); token_logprobs cannot read them")
    targets = batch.target_ids.to(device)
    if chunked:
        return _chunked(model, kept["hidden"], logits[0], targets, temperature, chunk_tokens)
    logits = logits[0]
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    logp = torch.log_softmax(logits, dim=-1)
    return logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def _chunked(model, hidden, probe_logits, targets, temperature, chunk_tokens):
    """The chunked head over all targets, its post-processing read off the model's probe."""
    head = model.get_output_embeddings()
    post = LogitPost()
    if probe_logits.shape[0]:
        with torch.no_grad():
            raw = torch.nn.functional.linear(hidden[:probe_logits.shape[0]], head.weight,
                                             head.bias)
        post = read_post(model, raw, probe_logits)
    return chunked_logprobs(hidden, head, targets, post=post, temperature=temperature,
                            chunk_tokens=chunk_tokens)
