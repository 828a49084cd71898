"""Locally built models (no hub downloads): tiny HF causal LMs, a local tokenizer, a model
directory both HF and vLLM load, and a supervised warm start.

May import: torch, transformers, tokenizers and ``trajectory`` (the tree attention)."""

from ray_xlong.models.build import build_tiny_model_dir, load_model, load_tokenizer
from ray_xlong.models.tiny import TinyModelConfig, tiny_causal_lm
from ray_xlong.models.tokenizer import SPECIAL_TOKENS, build_tokenizer
from ray_xlong.models.supervised import TeacherForced, teacher_forced, warm_start

__all__ = ["SPECIAL_TOKENS", "TeacherForced", "TinyModelConfig", "build_tiny_model_dir",
           "build_tokenizer", "load_model", "load_tokenizer", "teacher_forced", "tiny_causal_lm",
           "warm_start"]
