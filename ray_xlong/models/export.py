"""A model that leaves: a Hugging Face directory written from a Learner's weights, one
safetensors file at a time, and the same directory from a sharded (DCP) checkpoint.

```
write_hf_dir(out, tensors, model_dir=…)   tensors: an iterator of (name, tensor) in any order;
                                          each file is written once it holds max_shard_bytes,
                                          then freed: the whole model is never in memory
  out/model.safetensors                   (one file) or model-0000i-of-0000n.safetensors +
                                          model.safetensors.index.json (HF's sharded layout)
  out/config.json …                       every other file of model_dir: config.json (its
                                          dtype set to the weights'), generation_config.json,
                                          tokenizer.json / tokenizer_config.json, the chat
                                          template, xlong_chat.json
dcp_tensors(dcp_dir)                      (name, tensor) of a checkpoint written by a Learner
                                          (``cells/shard_checkpoint.py``), read group by group
                                          with DCP's loader (no process group needed)
export_checkpoint(dcp_dir, out)           the two together (``ray-xlong export``)
```

The weights are written bit for bit as the Learner holds them (no cast). A tied output head
(``tie_word_embeddings``) is left out, as ``save_pretrained`` does.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
from typing import Iterable, Iterator

import torch

WEIGHT_FILES = ("*.safetensors", "*.bin", "*.pt", "*.pth", "model.safetensors.index.json",
                "pytorch_model.bin.index.json")
"""Files of the source model directory that are weights (not copied)."""
MODEL_KEY = "model"
"""Prefix of the weights in a Learner's DCP checkpoint (``{"model": {fqn: tensor}, …}``)."""
META_FILE = "xlong_learner.json"
"""Written beside a Learner's DCP checkpoint: ``{"model_dir": …, "version": v, …}``."""
MAX_SHARD_BYTES = 2 * 1024 ** 3


def _tied(config: dict) -> set[str]:
    return {"lm_head.weight"} if config.get("tie_word_embeddings") else set()


def write_hf_dir(out: str | os.PathLike, tensors: Iterable[tuple[str, torch.Tensor]], *,
                 model_dir: str | os.PathLike,
                 max_shard_bytes: int = MAX_SHARD_BYTES) -> pathlib.Path:
    """Write a Hugging Face model directory (module docstring).

    Args:
        out: the directory (created; weight files already there are replaced).
        tensors: ``(name, tensor)`` pairs, HF state-dict names.
        model_dir: the model directory the Learner was built from (config, tokenizer).
        max_shard_bytes: bytes per safetensors file at most (a bigger tensor goes alone).

    Returns:
        The directory.

    Raises:
        ValueError: ``model_dir`` has no ``config.json``, or no tensor was given.
    """
    from safetensors.torch import save_file

    src, dst = pathlib.Path(model_dir), pathlib.Path(out)
    cfg_path = src / "config.json"
    if not cfg_path.exists():
        raise ValueError(f"write_hf_dir: model_dir {src} has no config.json (the directory the "
                         f"Learner's model was built from is needed for its config and "
                         f"tokenizer)")
    config = json.loads(cfg_path.read_text())
    dst.mkdir(parents=True, exist_ok=True)
    for pattern in WEIGHT_FILES:
        for old in dst.glob(pattern):
            old.unlink()
    skip = _tied(config)
    files: list[list[str]] = []
    sizes: list[int] = []
    buf: dict[str, torch.Tensor] = {}
    size, dtype = 0, None

    def flush() -> None:
        nonlocal buf, size
        if buf:
            save_file(buf, str(dst / f".part-{len(files):05d}.safetensors"),
                      metadata={"format": "pt"})
            files.append(sorted(buf))
            sizes.append(size)
        buf, size = {}, 0

    for name, t in tensors:
        if name in skip:
            continue
        t = t.detach().to("cpu").contiguous()
        dtype = dtype or t.dtype
        n = t.numel() * t.element_size()
        if buf and size + n > max_shard_bytes:
            flush()
        buf[name] = t.clone() if t.untyped_storage().size() != n else t
        size += n
    flush()
    if not files:
        raise ValueError("write_hf_dir: no tensors to write")
    if len(files) == 1:
        os.replace(dst / ".part-00000.safetensors", dst / "model.safetensors")
    else:
        weight_map = {}
        for i, names in enumerate(files):
            final = f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"
            os.replace(dst / f".part-{i:05d}.safetensors", dst / final)
            weight_map.update({n: final for n in names})
        (dst / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": sum(sizes)}, "weight_map": weight_map}, indent=2))
    _copy_model_files(src, dst, config, dtype)
    return dst


def _copy_model_files(src: pathlib.Path, dst: pathlib.Path, config: dict,
                      dtype: torch.dtype | None) -> None:
    """Every non-weight file of ``src`` (tokenizer, chat template, generation config…);
    ``config.json`` with the weights' dtype."""
    weights = {p.name for pattern in WEIGHT_FILES for p in src.glob(pattern)}
    for p in src.iterdir():
        if p.is_file() and p.name not in weights and p.name not in ("config.json", META_FILE):
            shutil.copy2(p, dst / p.name)
    if dtype is not None:
        name = str(dtype).removeprefix("torch.")
        for key in ("torch_dtype", "dtype"):
            if key in config or key == "torch_dtype":
                config[key] = name
    (dst / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def dcp_keys(dcp_dir: str | os.PathLike) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Weight names of a Learner's DCP checkpoint → (shape, dtype), in checkpoint order."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    meta = FileSystemReader(str(dcp_dir)).read_metadata()
    prefix = MODEL_KEY + "."
    return {k[len(prefix):]: (tuple(m.size), m.properties.dtype)
            for k, m in meta.state_dict_metadata.items()
            if k.startswith(prefix) and isinstance(m, TensorStorageMetadata)}


def dcp_tensors(dcp_dir: str | os.PathLike, *,
                group_bytes: int = MAX_SHARD_BYTES) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` of the weights of a Learner's DCP checkpoint, loaded group by group
    (``group_bytes`` at most at once; every rank's shards of a tensor joined by DCP's loader).
    Runs in a plain process: no process group."""
    import torch.distributed.checkpoint as dcp

    keys = dcp_keys(dcp_dir)
    if not keys:
        raise ValueError(f"dcp_tensors: {dcp_dir} holds no '{MODEL_KEY}.*' weights (not a "
                         f"Learner checkpoint)")
    group: dict[str, torch.Tensor] = {}
    size = 0

    def load() -> Iterator[tuple[str, torch.Tensor]]:
        dcp.load({MODEL_KEY: group}, checkpoint_id=str(dcp_dir), no_dist=True)
        yield from group.items()

    for name, (shape, dtype) in keys.items():
        n = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        if group and size + n > group_bytes:
            yield from load()
            group, size = {}, 0
        group[name] = torch.empty(shape, dtype=dtype)
        size += n
    if group:
        yield from load()


def learner_meta(dcp_dir: str | os.PathLike) -> dict:
    """The :data:`META_FILE` beside a Learner's DCP checkpoint (``{}`` when absent)."""
    path = pathlib.Path(dcp_dir) / META_FILE
    return json.loads(path.read_text()) if path.exists() else {}


def export_checkpoint(dcp_dir: str | os.PathLike, out: str | os.PathLike, *,
                      model_dir: str | os.PathLike | None = None,
                      max_shard_bytes: int = MAX_SHARD_BYTES) -> pathlib.Path:
    """A Hugging Face directory from a Learner's DCP checkpoint (``model_dir``: where config
    and tokenizer come from; default: the one the checkpoint names)."""
    model_dir = model_dir or learner_meta(dcp_dir).get("model_dir")
    if not model_dir:
        raise ValueError(f"export_checkpoint: {dcp_dir} does not name its model directory "
                         f"({META_FILE}); pass model_dir")
    return write_hf_dir(out, dcp_tensors(dcp_dir, group_bytes=max_shard_bytes),
                        model_dir=model_dir, max_shard_bytes=max_shard_bytes)
