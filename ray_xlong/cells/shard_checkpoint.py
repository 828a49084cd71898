"""A Learner's own checkpoint: ``torch.distributed.checkpoint`` (DCP) of the state it holds —
every rank of a sharded cell writes its own shards — saved without blocking the step.

```
save(path, model, optimizer, version, meta)   waits for the previous save; stages the state
                                              (a copy) and returns; the files are written in
                                              a background thread (dcp.async_save); once they
                                              are, the writer (rank 0) writes
                                              path/xlong_learner.json and each of ``meta``'s
                                              files (the driver's small records), renamed
                                              into place last
wait()                                        the save in flight is done (its error raised)
load(path, model, optimizer)                  the state back (every rank its shards); version
```

Layout of ``path``: DCP's files (``.metadata``, ``__<rank>_0.distcp``) of
``{"model": {fqn: tensor}, "optim": {…}, "version": tensor}`` (no ``optim`` before the first
optimizer step: Adam has no state then, and making one would count a step) and
:data:`~ray_xlong.models.export.META_FILE`. ``models.export`` reads the weights back into a
Hugging Face directory without a process group.
"""

from __future__ import annotations

import json
import logging
import os
import pathlib
import threading
from typing import Any, Callable, Mapping

import torch

from ray_xlong.models.export import META_FILE, MODEL_KEY

log = logging.getLogger(__name__)
FORMAT = 1
"""Written into :data:`META_FILE`; a newer one is refused by :func:`load`."""


def _write_atomic(path: pathlib.Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class ShardCheckpointer:
    """One Learner process's DCP saves (module docstring).

    Args:
        rank: this process's rank in its cell (0 writes the metadata files).
        group: a factory of the process group the saves use (a sharded cell's own gloo group,
            apart from the training collectives: the save's collectives run in a background
            thread); None: a single process (no process group).
    """

    def __init__(self, *, rank: int = 0, group: Callable[[], Any] | None = None) -> None:
        self.rank, self._group_factory, self._group = rank, group, None
        self.future: Any = None
        self.path: str | None = None
        self.error: BaseException | None = None
        self.saved: list[str] = []
        """Checkpoints completed by this process, in order."""

    def _pg(self) -> Any:
        if self._group_factory is not None and self._group is None:
            self._group = self._group_factory()
        return self._group

    def save(self, path: str | os.PathLike, model: torch.nn.Module,
             optimizer: torch.optim.Optimizer, *, version: int, meta: Mapping[str, Any],
             files: Mapping[str, bytes] | None = None, block: bool = False) -> str:
        """Start saving (module docstring); ``meta`` goes into :data:`META_FILE`, ``files``
        (name → bytes, e.g. the driver's records) into ``path``'s parent, each once the state is
        on disk. Returns ``path``."""
        import torch.distributed.checkpoint as dcp

        self.wait(raise_error=False)
        path = str(path)
        pathlib.Path(path).mkdir(parents=True, exist_ok=True)
        state = _state_dict(model, optimizer, version)
        pg = self._pg()
        no_dist = pg is None
        info = {"format": FORMAT, "version": int(version), **dict(meta)}
        extra = dict(files or {})

        ran: list[bool] = []
        lock = threading.Lock()

        def done(fut: Any) -> None:   # once, from the writer's callback or from wait()
            with lock:
                if ran:
                    return
                ran.append(True)
                _finish(fut)

        def _finish(fut: Any) -> None:
            exc = fut.exception()
            if exc is not None:
                self.error = exc
                log.error("Learner checkpoint %s failed: %r (the next save retries)", path, exc)
                return
            if self.rank == 0:
                try:
                    _write_atomic(pathlib.Path(path) / META_FILE,
                                  json.dumps(info, sort_keys=True).encode())
                    for name, data in extra.items():
                        _write_atomic(pathlib.Path(path).parent / name, data)
                except OSError as err:
                    self.error = err
                    log.error("Learner checkpoint %s: writing its records failed: %r", path, err)
                    return
            self.saved.append(path)

        if block:
            dcp.save(state, checkpoint_id=path, process_group=pg, no_dist=no_dist)
            fut: Any = _Done()
        else:
            fut = dcp.async_save(state, checkpoint_id=path, process_group=pg, no_dist=no_dist)
            fut = getattr(fut, "upload_completion", fut)   # AsyncSaveResponse in newer torch
        self.future, self.path, self.error = fut, path, None
        self._done = done
        if block:
            done(fut)
            self.future = None
            if self.error is not None:
                raise self.error
        else:
            fut.add_done_callback(done)
        return path

    def wait(self, *, raise_error: bool = True) -> str | None:
        """Block until the save in flight is written (and its records); returns its path (None:
        none was in flight). Raises its error unless ``raise_error`` is False (then logged)."""
        fut, self.future = self.future, None
        if fut is None:
            return None
        try:
            fut.result()
        except Exception as exc:  # noqa: BLE001 - logged by the callback; the job goes on
            self.error = exc
        self._done(fut)          # its records written (the callback may still be running)
        if self.error is not None and raise_error:
            raise RuntimeError(f"Learner checkpoint {self.path} failed: {self.error!r}") \
                from self.error
        return self.path

    def load(self, path: str | os.PathLike, model: torch.nn.Module,
             optimizer: torch.optim.Optimizer, *, reset_optimizer: Callable[[], None]) -> int:
        """Load the checkpoint at ``path`` into ``model`` / ``optimizer`` (``reset_optimizer``:
        called instead when it holds no optimizer state). Returns its version.

        Raises:
            ValueError: not a Learner checkpoint, a newer format, or another model's shapes
                (naming both).
        """
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.state_dict import (StateDictOptions,
                                                             get_model_state_dict,
                                                             get_optimizer_state_dict,
                                                             set_model_state_dict,
                                                             set_optimizer_state_dict)

        self.wait(raise_error=False)
        path = str(path)
        info = _meta(path)
        if int(info.get("format", FORMAT)) > FORMAT:
            raise ValueError(f"Learner checkpoint {path}: format {info['format']} is newer than "
                             f"this version reads ({FORMAT})")
        try:
            saved = FileSystemReader(path).read_metadata().state_dict_metadata
        except (OSError, FileNotFoundError) as exc:
            raise ValueError(f"Learner checkpoint {path}: not a DCP checkpoint ({exc})") from exc
        model_sd = get_model_state_dict(model, options=StateDictOptions())
        _check_shapes(path, saved, model_sd)
        has_optim = any(k.startswith("optim.") for k in saved)
        state: dict[str, Any] = {MODEL_KEY: model_sd, "version": torch.zeros((), dtype=torch.long)}
        if has_optim:
            state["optim"] = get_optimizer_state_dict(model, optimizer)
        dcp.load(state, checkpoint_id=path, process_group=self._pg(),
                 no_dist=self._pg() is None)
        set_model_state_dict(model, state[MODEL_KEY])
        if has_optim:
            set_optimizer_state_dict(model, optimizer, state["optim"])
        else:
            reset_optimizer()
        for p in model.parameters():
            p.grad = None
        return int(state["version"])


class _Done:
    """A finished future (a blocking save)."""

    def result(self) -> None:
        return None

    def exception(self) -> None:
        return None


def _meta(path: str) -> dict:
    p = pathlib.Path(path) / META_FILE
    return json.loads(p.read_text()) if p.exists() else {}


def _state_dict(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                version: int) -> dict[str, Any]:
    """What a save writes: the model's (sharded) state dict, Adam's (once it has state: making
    one counts a step), the version."""
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict,
                                                         get_optimizer_state_dict)

    state: dict[str, Any] = {MODEL_KEY: get_model_state_dict(model),
                             "version": torch.tensor(int(version), dtype=torch.long)}
    if optimizer.state:
        state["optim"] = get_optimizer_state_dict(model, optimizer)
    return state


def _check_shapes(path: str, saved: Mapping[str, Any], model_sd: Mapping[str, Any]) -> None:
    """The checkpoint holds this model's weights with these shapes (else an error naming
    both)."""
    want = {f"{MODEL_KEY}.{k}": tuple(v.shape) for k, v in model_sd.items()}
    got = {k: tuple(m.size) for k, m in saved.items()
           if k.startswith(MODEL_KEY + ".") and hasattr(m, "size")}
    if want.keys() != got.keys() or any(want[k] != got[k] for k in want):
        diff = sorted(k for k in want.keys() | got.keys() if want.get(k) != got.get(k))[:3]
        raise ValueError(f"Learner checkpoint {path} is of another model shape: "
                         + "; ".join(f"{k}: checkpoint {got.get(k)} vs model {want.get(k)}"
                                     for k in diff))


def exists(path: str | os.PathLike) -> bool:
    """``path`` holds a completed Learner checkpoint (its metadata written last)."""
    return (pathlib.Path(path) / META_FILE).exists()


LATEST = "latest.json"
"""In a job's ``checkpoint_dir``: the last completed checkpoint, ``{"version",
"learner_dir"}`` (written last, by the Learner that wrote it; ``cells/checkpoint.py``)."""


def latest(root: str | os.PathLike | None) -> tuple[int, pathlib.Path] | None:
    """(version, Learner checkpoint dir) of the last completed checkpoint of a job's
    ``checkpoint_dir`` (None: none yet, or no directory)."""
    if not root:
        return None
    p = pathlib.Path(root) / LATEST
    try:
        info = json.loads(p.read_text())
    except (OSError, ValueError):
        return None
    return int(info["version"]), pathlib.Path(root) / info["learner_dir"]
