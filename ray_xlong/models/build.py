"""A tiny model directory on disk: HF weights (safetensors) + the local tokenizer, one seed.

``build_tiny_model_dir(path, seed=..., arch=...)`` writes what both backends load::

    path/
      config.json              Qwen2ForCausalLM | LlamaForCausalLM, head_dim 64, float32
      model.safetensors        seeded random (or warm-started) weights
      generation_config.json
      tokenizer.json           byte-level BPE + chat specials (models/tokenizer.py)
      tokenizer_config.json
      chat_template.jinja      with ``style="chatml" | "llama3"`` (the template format)
      xlong_chat.json          {"format": ..., "tool_parser": ...}: how the harness talks to it

Invariants: the same arguments give byte-identical weights and the same vocabulary; the model's
vocabulary covers the tokenizer's (rounded up to a multiple of 64); bos / eos / pad ids in the
model config equal the tokenizer's. Nothing is downloaded.
"""

from __future__ import annotations

import dataclasses
import pathlib
from typing import Callable, Sequence

import torch

from ray_xlong.models.tiny import TinyModelConfig, tiny_causal_lm
from ray_xlong.models.tokenizer import build_tokenizer

TrainFn = Callable[[torch.nn.Module, object], None]
"""``train(model, tokenizer) -> None``: optional in-place training before saving (warm start)."""


def _round_up(n: int, multiple: int = 64) -> int:
    return -(-n // multiple) * multiple


def build_tiny_model_dir(path: str | pathlib.Path, *, seed: int = 0, arch: str = "qwen2",
                         config: TinyModelConfig | None = None, tokenizer_vocab: int = 512,
                         extra_texts: Sequence[str] = (), dtype: torch.dtype = torch.float32,
                         train: TrainFn | None = None, style: str = "token") -> pathlib.Path:
    """Build and save a tiny causal LM + tokenizer that HF and vLLM both load.

    Args:
        path: the directory (created; existing files are overwritten).
        seed: weight seed.
        arch: ``qwen2`` | ``llama`` (ignored when ``config`` is given).
        config: the model shape; its ``vocab_size`` is raised to cover the tokenizer when
            smaller than it would need (None: ``TinyModelConfig(arch=arch)``).
        tokenizer_vocab: BPE vocabulary size (see ``build_tokenizer``).
        extra_texts: more tokenizer training text.
        dtype: weight dtype saved (float32 default; vLLM CPU also takes bfloat16).
        train: optional warm start applied before saving.
        style: tokenizer style (``token`` | ``chatml`` | ``llama3``; ``build_tokenizer``); the
            chat format and tool parser the harness uses go to ``xlong_chat.json``.

    Returns:
        The directory path.
    """
    out = pathlib.Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(vocab_size=tokenizer_vocab, extra_texts=extra_texts, style=style)
    cfg = config if config is not None else TinyModelConfig(arch=arch)
    need = _round_up(len(tokenizer))
    if cfg.vocab_size < need:
        cfg = dataclasses.replace(cfg, vocab_size=need)
    model = tiny_causal_lm(cfg, seed=seed, dtype=dtype)
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = getattr(tokenizer, name)
        setattr(model.config, name, value)
        setattr(model.generation_config, name, value)
    if train is not None:
        train(model, tokenizer)
        model.eval()
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    write_chat_config(out, style=style)
    return out


CHAT_CONFIG = "xlong_chat.json"
"""File in a model directory naming its chat format and tool parser (optional for user dirs)."""


def write_chat_config(path: str | pathlib.Path, *, style: str) -> None:
    """Write :data:`CHAT_CONFIG` for a tokenizer style (``token`` → the token format)."""
    import json

    from ray_xlong.models.templates import STYLES

    conf = ({"format": "token", "tool_parser": None} if style == "token" else
            {"format": "template", "tool_parser": STYLES[style]["tool_parser"]})
    (pathlib.Path(path) / CHAT_CONFIG).write_text(json.dumps(conf) + "\n")


def load_tokenizer(path: str | pathlib.Path):
    """The tokenizer saved by :func:`build_tiny_model_dir` (a ``PreTrainedTokenizerFast``)."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(str(path))


def load_model(path: str | pathlib.Path, *, dtype: torch.dtype = torch.float32,
               attn_implementation: str = "sdpa") -> torch.nn.Module:
    """The model saved by :func:`build_tiny_model_dir`, in eval mode."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype,
                                                 attn_implementation=attn_implementation)
    return model.eval()
