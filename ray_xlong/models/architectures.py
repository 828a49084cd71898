"""Tiny random causal LMs of many HF architectures, built from configs (never downloaded).

Each entry switches on the architecture's distinctive logits / attention features and keeps
them small enough to matter on short sequences (``WINDOW``-token sliding windows, soft-capping
at 2-5, logit scales far from 1), for the exact-loss checks (``benchmarks/architectures.py``,
``tests/trajectory/test_model_architectures.py``)::

    name                      HF model_type   feature
    gemma2-softcap-sliding    gemma2          final + attention soft-capping, alternating windows
    cohere-logit-scale        cohere          logits × logit_scale
    granite-logits-scaling    granite         logits ÷ logits_scaling (+ other multipliers)
    mistral-sliding           mistral         every layer sliding
    ...
"""

from __future__ import annotations

import torch

COMMON = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=2, num_key_value_heads=1, head_dim=32,
              max_position_embeddings=512, tie_word_embeddings=False, pad_token_id=0,
              bos_token_id=1, eos_token_id=2)
WINDOW = 6
ARCHS: dict[str, tuple[str, dict, str]] = {
    # name: (model_type, config overrides, dense attention implementation)
    "llama": ("llama", {}, "sdpa"),
    "qwen2": ("qwen2", {}, "sdpa"),
    "qwen2-sliding": ("qwen2", dict(use_sliding_window=True, sliding_window=WINDOW,
                                    max_window_layers=1), "sdpa"),
    "qwen3": ("qwen3", {}, "sdpa"),
    "mistral-sliding": ("mistral", dict(sliding_window=WINDOW), "sdpa"),
    "gemma": ("gemma", {}, "sdpa"),
    "gemma2-softcap-sliding": ("gemma2", dict(final_logit_softcapping=2.0,
                                              attn_logit_softcapping=5.0,
                                              sliding_window=WINDOW, query_pre_attn_scalar=32),
                               "eager"),
    "gemma3-sliding": ("gemma3_text", dict(sliding_window=WINDOW, final_logit_softcapping=3.0,
                                           query_pre_attn_scalar=32,
                                           layer_types=["sliding_attention",
                                                        "full_attention"]), "sdpa"),
    "cohere-logit-scale": ("cohere", dict(logit_scale=0.25), "sdpa"),
    "cohere2-scale-sliding": ("cohere2", dict(logit_scale=0.25, sliding_window=WINDOW,
                                              layer_types=["sliding_attention",
                                                           "full_attention"]), "sdpa"),
    "granite-logits-scaling": ("granite", dict(logits_scaling=4.0, embedding_multiplier=2.0,
                                               residual_multiplier=0.5,
                                               attention_multiplier=0.2), "sdpa"),
    "phi3": ("phi3", {}, "sdpa"),
    "olmo2": ("olmo2", {}, "sdpa"),
    "starcoder2-sliding": ("starcoder2", dict(sliding_window=WINDOW), "sdpa"),
    "stablelm": ("stablelm", {}, "sdpa"),
}


def build_arch(name: str, *, seed: int = 0, attn_implementation: str = "sdpa",
               dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """A tiny random model of architecture ``name`` (:data:`ARCHS`), in eval mode."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from ray_xlong.trajectory.tree_attention import register

    register()
    if name not in ARCHS:
        raise ValueError(f"build_arch: name must be one of {sorted(ARCHS)}, got {name!r}")
    model_type, overrides, _ = ARCHS[name]
    config = AutoConfig.for_model(model_type, **{**COMMON, **overrides})
    config._attn_implementation = attn_implementation
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
