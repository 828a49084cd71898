"""The run spool: a write-ahead log of ended runs, so that no finished run is lost with the
actor or driver that held it (docs/design.md, invariant 9).

```
runner: run ends ─► spool.put(cell, result)   one file per run, written then renamed (atomic)
driver: result delivered (wait_ended) ─► kept until a completed checkpoint covers the step
        that trained it (checkpoint.collect) ─► spool.discard(ids)
runner dies ─► driver reads spool.get() for the cell's runs still live ─► delivered from disk
driver dies ─► new driver reads every spooled run the checkpoint still owes
state lost ─► the runs of every step since the last checkpoint, read back in the order the
        step records name them, are trained again (recovery.Recovery.reload_checkpoint)
```

A run ends into the spool *before* it is handed to the driver, so an actor that dies between the
two loses nothing. Per run: ``<run_id>.info`` (a pickle of ``(cell, RunInfo)``), then the run
itself as ``<run_id>.jsonl`` in the recording format (``trajectory/recording.py``: contexts as
deltas, so a paper-scale run costs its unique tokens, not hundreds of copies of its context),
renamed into place last: a run is spooled once its ``.jsonl`` exists; readers ignore temporary
files. On a multi-node cluster the spool directory must be on
storage every node and the driver see (NFS, a mounted bucket); on one machine (tests, the local
``cluster_utils`` cluster) a local directory is that.
"""

from __future__ import annotations

import os
import pathlib
import pickle
from typing import Any, Iterable

from ray_xlong.trajectory.recording import read_runs, write_runs


class RunSpool:
    """One directory of spooled run results (see module docstring)."""

    def __init__(self, root: str | os.PathLike) -> None:
        self.root = pathlib.Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    def put(self, cell: int, result: Any) -> None:
        """Persist ``result`` (a ``RunResult``) of a run that ended on ``cell``."""
        run_id = result.run.run_id
        with open(self.root / f"{run_id}.info", "wb") as f:
            pickle.dump((cell, result.info), f, protocol=pickle.HIGHEST_PROTOCOL)
        tmp = self.root / f".{run_id}.{os.getpid()}.tmp.jsonl"
        write_runs(str(tmp), [result.run])
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, self.root / f"{run_id}.jsonl")

    def run_ids(self) -> set[str]:
        """Ids of every spooled run."""
        return {p.stem for p in self.root.glob("*.jsonl") if not p.name.startswith(".")}

    def get(self, run_ids: Iterable[str] | None = None) -> dict[str, tuple[int, Any]]:
        """``{run_id: (cell, RunResult)}`` of the spooled runs (all, or those of ``run_ids``
        that are spooled)."""
        wanted = self.run_ids() if run_ids is None else set(run_ids) & self.run_ids()
        from ray_xlong.rollout.run_records import RunResult

        out = {}
        for run_id in sorted(wanted):
            with open(self.root / f"{run_id}.info", "rb") as f:
                cell, info = pickle.load(f)
            (run,) = read_runs(str(self.root / f"{run_id}.jsonl"))
            out[run_id] = (cell, RunResult(run, info))
        return out

    def discard(self, run_ids: Iterable[str]) -> None:
        """Forget runs that are safe elsewhere (trained and checkpointed, or in a checkpoint)."""
        for run_id in run_ids:
            (self.root / f"{run_id}.jsonl").unlink(missing_ok=True)
            (self.root / f"{run_id}.info").unlink(missing_ok=True)
