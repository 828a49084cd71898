"""Dataset tasks: one row of a dataset = one task instance, the user's environment around it.

A :class:`DatasetTask` is a task factory (``make(i) -> TaskEnv``) over rows read from JSONL,
parquet or a Hugging Face ``datasets`` split, with the user's ``env(row) -> TaskEnv`` (or
:class:`PromptEnv`: prompt in, answer scored by a reward function)::

    task = DatasetTask.from_jsonl("train.jsonl", env=PromptEnv.factory(reward=exact_match),
                                  seed=0)
    train, held_out = task.split(eval_fraction=0.1)       disjoint rows, deterministic per seed
    config.xlong(task=train, eval_task=held_out)

Instance order. A training job calls ``make(i)`` with the global group index ``i``
(``indexed_instances``): every run of group ``i`` gets the same row, and the stream walks the
rows epoch by epoch, each epoch in its own order drawn from ``(seed, epoch)``::

    n = 4 rows, seed 0      i:     0 1 2 3 | 4 5 6 7 | 8 …
                            epoch: 0 0 0 0 | 1 1 1 1 | 2
                            row:   2 0 3 1 | 1 3 0 2 | …     (a permutation per epoch)

The position is ``i`` itself: a checkpoint stores the next group index (``XLongAlgorithm``
state ``xlong/data_position``) and a restored job continues there. Rows are checked when read
(each must be an object with the ``required`` keys); a bad row raises :class:`DatasetRowError`
naming the file and the row (0-based; JSONL also gives the line), at load or when its
environment cannot be built.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np

from ray_xlong.rollout.tasks.base import Observation, TaskEnv, ToolError


class DatasetRowError(ValueError):
    """A row of a dataset is bad; the message names the file (source) and the row."""


@dataclasses.dataclass(frozen=True, slots=True)
class DataPosition:
    """Where instance ``index`` of a dataset stream falls."""

    index: int
    """The global instance (group) index."""
    epoch: int
    """Passes over the rows before this one."""
    offset: int
    """Position within the epoch's order."""
    row: int
    """The row of the dataset (0-based, in file order)."""


class DatasetTask:
    """A task factory over the rows of a dataset (module docstring)."""

    indexed_instances = True
    """``TaskJob`` calls ``make(i)`` with the global group index, not a hashed seed."""

    def __init__(self, rows: Sequence[Mapping[str, Any]], *, env: Callable[[Mapping], TaskEnv],
                 name: str, seed: int = 0, source: str = "<rows>",
                 row_ids: Sequence[int] | None = None,
                 required: Iterable[str] = ()) -> None:
        """Args:
            rows: the instances (mappings; kept as plain dicts).
            env: ``env(row) -> TaskEnv`` (picklable; it travels to the cells).
            name: the task's name (what runs carry as ``RunSpec.task``).
            seed: shuffling seed (per epoch order).
            source: the file or dataset the rows came from (named in errors).
            row_ids: each row's index in ``source`` (default 0..n-1; a split keeps them).
            required: keys every row must have.
        """
        if not callable(env):
            raise TypeError(f"DatasetTask.env must be env(row) -> TaskEnv, got {env!r}")
        if not isinstance(name, str) or not name:
            raise ValueError(f"DatasetTask.name must be a non-empty string, got {name!r}")
        self.rows = [dict(r) if isinstance(r, Mapping) else r for r in rows]
        self.row_ids = list(row_ids) if row_ids is not None else list(range(len(self.rows)))
        self.env, self.name, self.seed, self.source = env, name, int(seed), source
        self.required = tuple(required)
        for k, row in enumerate(self.rows):
            _check_row(row, self.required, source, self.row_ids[k])
        if not self.rows:
            raise DatasetRowError(f"{source}: no rows")

    # -- readers --------------------------------------------------------------------------------
    @classmethod
    def from_jsonl(cls, path: str | pathlib.Path, *, env: Callable[[Mapping], TaskEnv],
                   name: str | None = None, seed: int = 0,
                   required: Iterable[str] = ()) -> "DatasetTask":
        """Rows from a JSON-lines file (one object per line; blank lines skipped)."""
        path = pathlib.Path(path)
        rows, ids = [], []
        with open(path, encoding="utf-8") as f:
            for line_no, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as exc:
                    raise DatasetRowError(f"{path}: row {len(rows)} (line {line_no}): invalid "
                                          f"JSON ({exc.msg})") from None
                ids.append(len(ids))
        return cls(rows, env=env, name=name or path.stem, seed=seed, source=str(path),
                   row_ids=ids, required=required)

    @classmethod
    def from_parquet(cls, path: str | pathlib.Path, *, env: Callable[[Mapping], TaskEnv],
                     name: str | None = None, seed: int = 0,
                     required: Iterable[str] = ()) -> "DatasetTask":
        """Rows from a parquet file (pyarrow; columns become keys)."""
        import pyarrow.parquet as pq

        path = pathlib.Path(path)
        rows = pq.read_table(path).to_pylist()
        return cls(rows, env=env, name=name or path.stem, seed=seed, source=str(path),
                   required=required)

    @classmethod
    def from_hf(cls, dataset: Any, *, env: Callable[[Mapping], TaskEnv], name: str,
                split: str | None = None, seed: int = 0,
                required: Iterable[str] = ()) -> "DatasetTask":
        """Rows of a Hugging Face ``datasets`` split: a ``datasets.Dataset``, or a local data
        file (``.jsonl`` / ``.json`` / ``.parquet`` / ``.csv``, loaded by its builder, split
        ``train`` unless given), a directory or a hub name, loaded with
        ``datasets.load_dataset(..., split=split)``."""
        if isinstance(dataset, (str, pathlib.Path)):
            source = f"{dataset}[{split or 'train'}]"
            dataset = _load_hf(str(dataset), split)
        else:
            source = f"{getattr(dataset, 'info', None) and dataset.info.dataset_name or name}" \
                     f"[{split or getattr(dataset, 'split', None)}]"
        return cls(dataset.to_list(), env=env, name=name, seed=seed, source=source,
                   required=required)

    # -- the stream -----------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.rows)

    def position(self, index: int) -> DataPosition:
        """Where global instance ``index`` falls (epoch, offset, row)."""
        if index < 0:
            raise ValueError(f"DatasetTask.position: index must be >= 0, got {index}")
        epoch, offset = divmod(int(index), len(self.rows))
        order = np.random.default_rng([self.seed, epoch]).permutation(len(self.rows))
        return DataPosition(int(index), epoch, offset, int(order[offset]))

    def row(self, index: int) -> dict[str, Any]:
        """The row instance ``index`` uses."""
        return self.rows[self.position(index).row]

    def __call__(self, index: int) -> TaskEnv:
        """A fresh environment for instance ``index`` (:class:`DatasetRowError` naming the
        source and row when ``env`` fails on it)."""
        k = self.position(index).row
        try:
            return self.env(self.rows[k])
        except DatasetRowError:
            raise
        except Exception as exc:
            raise DatasetRowError(f"{self.source}: row {self.row_ids[k]}: the environment "
                                  f"failed on it ({type(exc).__name__}: {exc})") from exc

    def split(self, *, eval_fraction: float | None = None, eval_rows: int | None = None,
              eval_name: str | None = None) -> tuple["DatasetTask", "DatasetTask"]:
        """Disjoint train / held-out tasks (rows drawn from ``seed``; each keeps the source's
        row numbers for errors). Give exactly one of ``eval_fraction`` (0..1) or
        ``eval_rows``."""
        n = len(self.rows)
        if (eval_fraction is None) == (eval_rows is None):
            raise ValueError("DatasetTask.split: give exactly one of eval_fraction, eval_rows")
        k = eval_rows if eval_rows is not None else int(round(n * float(eval_fraction)))
        if not 1 <= k < n:
            raise ValueError(f"DatasetTask.split: the held-out part must have 1..{n - 1} rows "
                             f"(of {n}), got {k}")
        order = np.random.default_rng([self.seed, 2**31 - 1]).permutation(n)
        held, kept = sorted(order[:k].tolist()), sorted(order[k:].tolist())
        return (self._subset(kept, self.name),
                self._subset(held, eval_name or f"{self.name}_eval"))

    def _subset(self, rows: list[int], name: str) -> "DatasetTask":
        return DatasetTask([self.rows[i] for i in rows], env=self.env, name=name,
                           seed=self.seed, source=self.source,
                           row_ids=[self.row_ids[i] for i in rows], required=self.required)

    def __repr__(self) -> str:
        return (f"DatasetTask(name={self.name!r}, rows={len(self.rows)}, source={self.source!r}, "
                f"seed={self.seed})")


HF_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
"""``datasets`` builder of a local data file, by suffix."""


def _load_hf(path: str, split: str | None) -> Any:
    import datasets

    builder = HF_BUILDERS.get(pathlib.Path(path).suffix)
    if builder is not None:
        return datasets.load_dataset(builder, data_files=path, split=split or "train")
    return datasets.load_dataset(path, split=split)


def _check_row(row: Any, required: tuple[str, ...], source: str, row_id: int) -> None:
    if not isinstance(row, Mapping):
        raise DatasetRowError(f"{source}: row {row_id}: must be an object, got "
                              f"{type(row).__name__}")
    missing = [k for k in required if k not in row]
    if missing:
        raise DatasetRowError(f"{source}: row {row_id}: missing key(s) {missing} "
                              f"(has {sorted(row)})")


def exact_match(answer: str, row: Mapping[str, Any]) -> float:
    """1.0 when the answer equals ``row["answer"]`` (stripped, as strings), else 0.0."""
    return float(answer.strip() == str(row.get("answer", "")).strip())


class PromptEnv:
    """A single-prompt environment for a row: ``row["prompt"]`` (and ``row["system"]``) in, the
    final answer scored by ``reward(answer, row) -> float``; no tools. A row may list the
    names of answers to accept etc. — whatever its reward function reads."""

    tools: tuple[dict, ...] = ()

    def __init__(self, row: Mapping[str, Any], *,
                 reward: Callable[[str, Mapping[str, Any]], float] = exact_match,
                 system: str = "Answer the question.") -> None:
        if not isinstance(row.get("prompt"), str):
            raise ValueError(f"PromptEnv: row['prompt'] must be a string, got "
                             f"{row.get('prompt')!r}")
        self.row, self.reward = row, reward
        self.system = str(row.get("system", system))
        self.answer: str | None = None

    @classmethod
    def factory(cls, *, reward: Callable[[str, Mapping[str, Any]], float] = exact_match,
                system: str = "Answer the question.") -> Callable[[Mapping], "PromptEnv"]:
        """``env(row)`` for :class:`DatasetTask` with this reward and default system prompt."""
        return _PromptFactory(reward, system)

    def reset(self) -> Observation:
        self.answer = None
        return Observation(self.system, self.row["prompt"])

    async def call_tool(self, name: str, args: dict) -> str:
        raise ToolError(f"this task has no tools (called {name!r})")

    def submit(self, answer: str) -> None:
        self.answer = answer

    def score(self) -> float:
        return float(self.reward(self.answer, self.row)) if self.answer is not None else 0.0

    def close(self) -> None:
        pass


@dataclasses.dataclass(frozen=True, slots=True)
class _PromptFactory:
    reward: Callable[[str, Mapping[str, Any]], float]
    system: str

    def __call__(self, row: Mapping[str, Any]) -> PromptEnv:
        return PromptEnv(row, reward=self.reward, system=self.system)
