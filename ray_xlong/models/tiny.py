"""Tiny HF causal LMs built from a config with seeded random weights (never downloaded).

Qwen2 or Llama architecture, ``head_dim`` 64 (vLLM's CPU attention rejects smaller heads), any
dtype and attention implementation. Deterministic per seed.

HF's RMSNorm computes its variance in float32 whatever the model dtype; a float64 model gets its
norms switched to float64 so that it is float64 end to end (exactness tests compare at 1e-9).
"""

from __future__ import annotations

import dataclasses
import types

import torch


@dataclasses.dataclass(frozen=True, slots=True)
class TinyModelConfig:
    """Shape of a tiny causal LM."""

    arch: str = "qwen2"
    """``qwen2`` | ``llama``."""
    vocab_size: int = 256
    """Vocabulary size."""
    hidden_size: int = 128
    """Model width (``num_heads × 64``)."""
    num_layers: int = 2
    """Decoder layers."""
    num_heads: int = 2
    """Attention heads (head_dim = hidden_size / num_heads = 64)."""
    num_kv_heads: int = 1
    """Key/value heads (grouped-query attention)."""
    intermediate_size: int = 256
    """MLP width."""
    max_position_embeddings: int = 4096
    """Longest position id."""

    def __post_init__(self) -> None:
        if self.arch not in ("qwen2", "llama"):
            raise ValueError(f"TinyModelConfig.arch must be 'qwen2' or 'llama', got {self.arch!r}")
        if self.hidden_size % self.num_heads or self.hidden_size // self.num_heads != 64:
            raise ValueError(f"TinyModelConfig.hidden_size / num_heads must be 64 (head_dim), "
                             f"got {self.hidden_size} / {self.num_heads}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError("TinyModelConfig.num_kv_heads must divide num_heads")

    def hf_config(self, *, attn_implementation: str = "sdpa"):
        """The transformers config object."""
        from transformers import LlamaConfig, Qwen2Config

        cls = Qwen2Config if self.arch == "qwen2" else LlamaConfig
        cfg = cls(vocab_size=self.vocab_size, hidden_size=self.hidden_size,
                  num_hidden_layers=self.num_layers, num_attention_heads=self.num_heads,
                  num_key_value_heads=self.num_kv_heads, intermediate_size=self.intermediate_size,
                  max_position_embeddings=self.max_position_embeddings, tie_word_embeddings=False,
                  head_dim=64)
        cfg._attn_implementation = attn_implementation
        return cfg


def tiny_causal_lm(config: TinyModelConfig = TinyModelConfig(), *, seed: int = 0,
                   dtype: torch.dtype = torch.float32,
                   attn_implementation: str = "sdpa") -> torch.nn.Module:
    """A randomly initialised tiny causal LM (deterministic per seed), in eval mode."""
    from transformers import AutoModelForCausalLM

    if attn_implementation == "xlong_tree":
        from ray_xlong.trajectory.tree_attention import register

        register()
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config.hf_config(
        attn_implementation=attn_implementation), dtype=dtype)
    if dtype == torch.float64:
        full_precision_norms(model)
    return model.eval()


def _rmsnorm_in_input_dtype(self, hidden_states: torch.Tensor) -> torch.Tensor:
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


def full_precision_norms(model: torch.nn.Module) -> int:
    """Make every HF RMSNorm of ``model`` compute in its input dtype; returns how many."""
    count = 0
    for module in model.modules():
        if type(module).__name__.endswith("RMSNorm") and hasattr(module, "variance_epsilon"):
            module.forward = types.MethodType(_rmsnorm_in_input_dtype, module)
            count += 1
    return count
