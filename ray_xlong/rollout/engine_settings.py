"""Long-context settings of a vLLM engine, checked against the model before vLLM is built.

::

    EngineSettings(max_model_len=None | n,      None: the model's own length (config.json
                   tensor_parallel_size=T,        max_position_embeddings), never a guess
                   enforce_eager=None | bool,     None: CUDA graphs on GPU, eager on CPU
                   enable_prefix_caching=True,    a run's calls share their prefix
                   gpu_memory_utilization=0.4)

:func:`model_max_len` reads the model's length; :func:`resolve_max_model_len` refuses a
``max_model_len`` above it (an error naming both numbers) and a model directory that states no
length when none is given. :func:`eager` decides CUDA graphs. Pure: no vLLM, no torch.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib

LENGTH_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")
"""The config.json keys that state a model's longest context (first found wins; a
``text_config`` of a multimodal config is read too)."""


@dataclasses.dataclass(frozen=True, slots=True)
class EngineSettings:
    """How a vLLM engine is sized; validated at construction (errors name the field)."""

    max_model_len: int | None = None
    """Longest context; None: the model's (``config.json``: ``max_position_embeddings``)."""
    tensor_parallel_size: int = 1
    """GPUs of one engine (vLLM's multiprocessing executor when > 1)."""
    enforce_eager: bool | None = None
    """True: no CUDA graphs; None: CUDA graphs on GPU, eager on CPU (vLLM's CPU backend)."""
    enable_prefix_caching: bool = True
    """vLLM's prefix cache (a run's calls extend one another: keep it on)."""
    gpu_memory_utilization: float = 0.4
    """vLLM's share of the GPU (weights + KV cache); the rest is a colocated Learner's."""

    def __post_init__(self) -> None:
        check_max_model_len(self.max_model_len, "EngineSettings.max_model_len")
        tp = self.tensor_parallel_size
        if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
            raise ValueError(f"EngineSettings.tensor_parallel_size must be an int >= 1, "
                             f"got {tp!r}")
        if self.enforce_eager is not None and not isinstance(self.enforce_eager, bool):
            raise ValueError(f"EngineSettings.enforce_eager must be None or a bool, "
                             f"got {self.enforce_eager!r}")
        if not isinstance(self.enable_prefix_caching, bool):
            raise ValueError(f"EngineSettings.enable_prefix_caching must be a bool, "
                             f"got {self.enable_prefix_caching!r}")
        util = self.gpu_memory_utilization
        if isinstance(util, bool) or not isinstance(util, (int, float)) or not 0 < util <= 1:
            raise ValueError(f"EngineSettings.gpu_memory_utilization must be in (0, 1], "
                             f"got {util!r}")


def check_max_model_len(value: object, field: str) -> None:
    """Raise ValueError naming ``field`` unless ``value`` is None or an int >= 1."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                              or value < 1):
        raise ValueError(f"{field} must be None (the model's length) or an int >= 1, "
                         f"got {value!r}")


def model_max_len(model_dir: str | pathlib.Path) -> int | None:
    """The model's longest context from its ``config.json`` (None: it states none)."""
    path = pathlib.Path(model_dir) / "config.json"
    if not path.is_file():
        raise ValueError(f"model_dir {str(model_dir)!r}: no config.json (not a HF model dir)")
    conf = json.loads(path.read_text())
    for where in (conf, conf.get("text_config") or {}):
        for key in LENGTH_KEYS:
            value = where.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None


def resolve_max_model_len(model_dir: str | pathlib.Path, asked: int | None, *,
                          field: str = "max_model_len") -> int:
    """``asked``, or the model's length when None.

    Raises:
        ValueError: ``asked`` above the model's length (names both), or None asked of a
            model whose config states no length (names ``field``).
    """
    check_max_model_len(asked, field)
    limit = model_max_len(model_dir)
    if asked is None:
        if limit is None:
            raise ValueError(f"{field} is None but model_dir {str(model_dir)!r} states no "
                             f"length in config.json ({', '.join(LENGTH_KEYS)}); give "
                             f"{field}")
        return limit
    if limit is not None and asked > limit:
        raise ValueError(f"{field}={asked} is above what the model supports: "
                         f"max_position_embeddings={limit} (model_dir {str(model_dir)!r})")
    return asked


def eager(settings_eager: bool | None, *, cuda: bool) -> bool:
    """``enforce_eager`` for vLLM: as asked, else eager only off CUDA (CUDA graphs on GPU)."""
    return (not cuda) if settings_eager is None else settings_eager
