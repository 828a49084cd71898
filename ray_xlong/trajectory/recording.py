"""Recording: agent runs as JSONL, with each call's context stored as a delta.

A run's hundreds of calls share one growing context, so writing every ``input_ids`` in full
would store ~Σ context lengths (hundreds of millions of tokens for a paper-scale run). Each call
instead names a *base* (the previous call of the same agent) and how many leading tokens of the
base's context (its input + output) it shares; only the rest is written. Reading rebuilds the
inputs as views of per-agent buffers, so the zero-copy assembly path applies to read runs too.

Schema (one JSON object per line; ``.gz`` paths are gzip-compressed)::

    {"type": "run", "run_id": str, "group_id": str, "reward": float,
     "status": "finished" | "timeout" | "failed", "num_calls": int}
    {"type": "call", "run_id": str, "call_id": str, "agent_id": str,
     "kind": "main" | "summary" | "subagent", "parent_agent_id": str | null,
     "policy_version": int, "start_time": float, "end_time": float,
     "input": {"base": call_id | null, "shared": int, "suffix": [int, ...]},
     "output_ids": [int, ...], "output_logprobs": [float, ...]}

A run line is followed by its ``num_calls`` call lines, in call order. ``input_ids`` of a call =
``(base.input_ids ++ base.output_ids)[:shared] ++ suffix``. Reading validates every record
(``RecordError`` names the line).
"""

from __future__ import annotations

import gzip
import json
from typing import IO, Iterable, Iterator

import numpy as np

from ray_xlong.trajectory.records import AgentRun, ModelCall, RecordError
from ray_xlong.trajectory.assembly import common_prefix_len


def _open(path: str, mode: str) -> IO[str]:
    if str(path).endswith(".gz"):
        return gzip.open(path, mode + "t", encoding="utf-8")
    return open(path, mode, encoding="utf-8")


def shared_context(base: ModelCall, ids: np.ndarray) -> int:
    """How many leading tokens of ``ids`` equal ``base.input_ids ++ base.output_ids``."""
    n = common_prefix_len(base.input_ids, ids)
    if n == base.input_ids.size:
        n += common_prefix_len(base.output_ids, ids[n:])
    return n


def run_records(run: AgentRun) -> Iterator[dict]:
    """The JSON records of one run (see the schema)."""
    yield {"type": "run", "run_id": run.run_id, "group_id": run.group_id, "reward": run.reward,
           "status": run.status, "num_calls": len(run.calls)}
    last: dict[str, ModelCall] = {}
    for call in run.calls:
        base = last.get(call.agent_id)
        shared = shared_context(base, call.input_ids) if base is not None else 0
        yield {"type": "call", "run_id": run.run_id, "call_id": call.call_id,
               "agent_id": call.agent_id, "kind": call.kind,
               "parent_agent_id": call.parent_agent_id, "policy_version": call.policy_version,
               "start_time": call.start_time, "end_time": call.end_time,
               "input": {"base": base.call_id if shared else None, "shared": shared,
                         "suffix": call.input_ids[shared:].tolist()},
               "output_ids": call.output_ids.tolist(),
               "output_logprobs": call.output_logprobs.tolist()}
        last[call.agent_id] = call


def write_runs(path: str, runs: Iterable[AgentRun]) -> int:
    """Write runs as JSONL; returns the number of runs written."""
    count = 0
    with _open(path, "w") as f:
        for run in runs:
            for record in run_records(run):
                f.write(json.dumps(record, separators=(",", ":")) + "\n")
            count += 1
    return count


class _Chain:
    """A growing token buffer; a call's input and output are views of it."""

    def __init__(self, prefix: np.ndarray, extra: int) -> None:
        self.buf = np.empty(max(1024, 2 * (prefix.size + extra)), dtype=np.int64)
        self.buf[:prefix.size] = prefix
        self.used = prefix.size

    def reserve(self, extra: int) -> None:
        """Make room for ``extra`` tokens (earlier views keep the old buffer alive)."""
        if self.used + extra > self.buf.size:
            grown = np.empty(2 * (self.used + extra), dtype=np.int64)
            grown[:self.used] = self.buf[:self.used]
            self.buf = grown

    def append(self, tokens: np.ndarray) -> np.ndarray:
        self.reserve(tokens.size)
        self.buf[self.used:self.used + tokens.size] = tokens
        self.used += tokens.size
        return self.buf[self.used - tokens.size:self.used]


class _RunReader:
    """Rebuilds one run's calls from their records."""

    def __init__(self, header: dict) -> None:
        self.header = header
        self.calls: list[ModelCall] = []
        self.contexts: dict[str, tuple[_Chain, int]] = {}   # call id → (chain, context end)

    def add(self, rec: dict, where: str) -> None:
        suffix = np.asarray(rec["input"]["suffix"], dtype=np.int64)
        out = np.asarray(rec["output_ids"], dtype=np.int64)
        chain = self._chain_for(rec["input"], suffix.size + out.size, where)
        chain.reserve(suffix.size + out.size)      # input and output stay adjacent views
        chain.append(suffix)
        inp = chain.buf[:chain.used]
        out_view = chain.append(out)
        call = ModelCall(rec["call_id"], rec["agent_id"], rec["kind"], inp, out_view,
                         np.asarray(rec["output_logprobs"], dtype=np.float64),
                         rec["policy_version"], parent_agent_id=rec["parent_agent_id"],
                         start_time=rec.get("start_time", 0.0), end_time=rec.get("end_time", 0.0),
                         run_id=self.header["run_id"])
        self.calls.append(call)
        self.contexts[call.call_id] = (chain, chain.used)

    def _chain_for(self, spec: dict, extra: int, where: str) -> _Chain:
        base, shared = spec["base"], spec["shared"]
        if base is None or shared == 0:
            return _Chain(np.zeros(0, np.int64), extra)
        if base not in self.contexts:
            raise RecordError(f"{where}: input.base {base!r} names no earlier call of the run")
        chain, end = self.contexts[base]
        if shared > end:
            raise RecordError(f"{where}: input.shared {shared} exceeds the base context ({end})")
        if shared == end == chain.used:
            return chain                           # extends the chain: no copy
        return _Chain(chain.buf[:shared], extra)   # a branch: copy the shared prefix once

    def finish(self) -> AgentRun:
        h = self.header
        return AgentRun(h["run_id"], h["group_id"], self.calls, h["reward"], h["status"])


def read_runs(path: str) -> list[AgentRun]:
    """Read runs written by :func:`write_runs` (validated; errors name the line)."""
    runs: list[AgentRun] = []
    reader: _RunReader | None = None
    with _open(path, "r") as f:
        for lineno, line in enumerate(f, 1):
            where = f"{path}:{lineno}"
            try:
                rec = json.loads(line)
                kind = rec["type"]
                if kind == "run":
                    if reader is not None:
                        raise RecordError(f"{where}: run {reader.header['run_id']!r} has "
                                          f"{len(reader.calls)} of {reader.header['num_calls']} "
                                          f"calls")
                    reader = _RunReader(rec)
                elif kind == "call":
                    if reader is None or rec["run_id"] != reader.header["run_id"]:
                        raise RecordError(f"{where}: call {rec.get('call_id')!r} has no run line")
                    reader.add(rec, where)
                else:
                    raise RecordError(f"{where}: type {kind!r} is not 'run' or 'call'")
            except (KeyError, TypeError, json.JSONDecodeError) as exc:
                raise RecordError(f"{where}: malformed record ({exc!r})") from exc
            if reader is not None and len(reader.calls) == reader.header["num_calls"]:
                runs.append(reader.finish())
                reader = None
    if reader is not None:
        raise RecordError(f"{path}: run {reader.header['run_id']!r} is truncated")
    return runs
