"""Locally built models (no hub downloads): tiny HF causal LMs from a config."""

from ray_xlong.models.tiny import TinyModelConfig, tiny_causal_lm

__all__ = ["TinyModelConfig", "tiny_causal_lm"]
