"""Rollout engines side by side: the same concurrent multi-turn agent runs on vLLM and HF.

Workload (identical on every engine). ``--runs`` concurrent harness runs in groups of
``--group-size`` (a GRPO-like group: one task, several attempts), one seeded tiny model, greedy
(temperature 0), so both engines generate the same tokens and the comparison is like for like
(checked: ``same_tokens`` compares a digest of every call's input and output ids)::

    [bos][system] tool documentation (~--system-tokens, shared by ALL runs) [end]
    [user] group brief (~--brief-tokens, shared by the runs of a group)
           the run's own question (arithmetic task) + "attempt k" (one run's own) [end][assistant]
      turn 1 .. --calls: model output (--new-tokens) + tool result, appended: the context grows

This is the shape where a prefix cache matters: a long system prompt, group siblings sharing
their task statement, and every turn re-sending the previous turn's whole context. Malformed
outputs are not retried (``max_retries=0``): each call is a new turn on a longer context.
Compaction stays off (its budget is near the 4096-token capacity), so contexts only grow.

Per engine (each in its own subprocess; peak memory is that process's max RSS):
output tokens/s, prompt tokens/s (both over the wall time of the runs), prefix-cache hit rate
(Σ ``num_cached_tokens`` / Σ prompt tokens, from the engine's per-request counts), startup s.
Next to the measured hit rate, ``expected_hit_rate`` is what an ideal block cache of the
engine's block size (vLLM's, read from the engine: 128 on CPU) gives on the recorded calls
(see :func:`expected_cached`: full blocks of a prompt already hashed by an earlier request,
the last prompt token always recomputed), and ``block_ceiling_hit_rate`` its cap,
Σ ((n - 1) // B) B / Σ n: the shared prefix rounded down to whole blocks. HF has no
prefix cache (its hit rate is 0 by construction). Printed as a markdown table with the
vLLM / HF ratio; ``--json`` writes it.

    python benchmarks/rollout_engines.py --seed 0 --runs 16 --json out.json
    python benchmarks/rollout_engines.py --smoke            # tiny budget (CI smoke test)
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from benchmarks.tools.entry import bench_parser, finish  # noqa: E402

DEFAULT_BLOCK = 128
"""Block size assumed for ``expected_hit_rate`` when no vLLM engine reports its own."""

_DOCS = (
    "You are a coding agent working in a repository. Call a tool with <|call|> name args "
    "<|end|> and finish with <|answer|> text <|end|>. One tool call per turn.",
    "Tool write: write <path> then a newline then the file content. Writes the file inside "
    "the workspace; paths may not leave it. Example: write solution.py\ndef add(a, b):\n"
    "    return a + b\n",
    "Tool read: read <path>. Returns the content of a file in the workspace, or an error "
    "when the file does not exist. Example: read tests/test_solution.py",
    "Tool run_tests: run_tests. Runs python -m pytest -q on the workspace in a subprocess "
    "with a time limit and returns its output: collected items, passed, failed, error.",
    "Tool add: add <a> <b>. Returns the sum of two integers. Example: add 3 4 returns 7.",
    "Tool work: work <k>. Does step k of a long task; steps must be done in order. The tool "
    "may take a long time and returns a log of the work done in that step.",
    "Tool subagent: subagent <task>. Starts a child agent with its own context on the given "
    "subtask and returns its answer. Use it to delegate a step; it may not start subagents.",
    "Rules: read the tests before writing code. Write the file, then run the tests. When a "
    "test fails, read the output, fix the file and run the tests again. Keep answers short.",
    "Errors: an unknown tool, a malformed call or a crashing tool returns an error message "
    "as the tool result; the run goes on. Tool output longer than the limit is truncated.",
    "When the context is long it is summarized: the summary of progress so far replaces the "
    "conversation, after the system prompt and the task statement. Then continue the work.",
)
_BRIEF = (
    "The repository has a package with functions add, sub, mul and maxi, and a tests folder "
    "with test_solution.py. Write solution.py so that all tests pass.",
    "Each function takes two integers a and b. add returns a + b, sub returns a - b, mul "
    "returns a * b, maxi returns max(a, b). Run the tests after each change.",
    "The work has steps; finish every step in order with work, delegate long steps with "
    "subagent, and answer done when all steps are done and all tests pass.",
)


def _grow(chat, parts: tuple[str, ...], target: int, shift: int) -> str:
    """Sections of ``parts`` (cyclically, from ``shift``) until ``target`` tokens are reached."""
    text, i = "", 0
    while target > 0 and chat.encode(text).size < target:
        text += (" " if text else "") + parts[(shift + i) % len(parts)]
        i += 1
    return text


class SharedPromptTask:
    """An arithmetic task behind a long shared system prompt and a group-shared brief."""

    def __init__(self, inner, *, system: str, brief: str, attempt: int) -> None:
        self.inner, self.system, self.brief, self.attempt = inner, system, brief, attempt
        self.tools = inner.tools

    def reset(self):
        from ray_xlong.rollout.tasks.base import Observation

        obs = self.inner.reset()
        return Observation(self.system, f"{self.brief} {obs.prompt} Attempt {self.attempt}.")

    async def call_tool(self, name: str, args: str) -> str:
        return await self.inner.call_tool(name, args)

    def submit(self, answer: str) -> None:
        self.inner.submit(answer)

    def score(self) -> float:
        return self.inner.score()

    def close(self) -> None:
        self.inner.close()


def expected_cached(calls, block: int) -> tuple[list[int], list[int]]:
    """Per call: tokens an ideal block prefix cache serves, and the block ceiling.

    Calls are taken in the order they reached the engine (start time). A call's input hits the
    full blocks that equal a prefix of (a) the input of any call that reached the engine before
    it (vLLM V1 hashes a prompt's full blocks when it schedules it, so a request of the same
    batch reuses them) or (b) the input + output of a call that had finished before it started;
    at most ``(n - 1) // block`` blocks (the last prompt token is always recomputed). The
    ceiling is that cap alone (every block that could possibly be shared)."""
    def chain(ids: np.ndarray, nblocks: int):
        key = b""
        for k in range(nblocks):
            key = hashlib.blake2b(key + ids[k * block:(k + 1) * block].tobytes(),
                                  digest_size=16).digest()
            yield key

    order = sorted(range(len(calls)), key=lambda i: calls[i].start_time)
    by_end = sorted(range(len(calls)), key=lambda i: calls[i].end_time)
    cached_blocks: set[bytes] = set()
    hits_out, ceiling = [0] * len(calls), [0] * len(calls)
    j = 0
    for i in order:
        while j < len(by_end) and calls[by_end[j]].end_time <= calls[i].start_time:
            c = calls[by_end[j]]
            seq = np.concatenate([np.asarray(c.input_ids), np.asarray(c.output_ids)[:-1]])
            cached_blocks.update(chain(seq.astype(np.int64), seq.size // block))
            j += 1
        inp = np.asarray(calls[i].input_ids, np.int64)
        hits = 0
        for key in chain(inp, (inp.size - 1) // block):
            if key not in cached_blocks:
                break
            hits += 1
        hits_out[i], ceiling[i] = hits * block, (inp.size - 1) // block * block
        cached_blocks.update(chain(inp, inp.size // block))
    return hits_out, ceiling


def measure(engine_name: str, model_dir: str, args: argparse.Namespace) -> dict:
    """Run the workload on one engine in this process; returns its metrics."""
    import torch

    from ray_xlong.models import load_tokenizer
    from ray_xlong.rollout import TokenFormat, HFEngine, Harness, HarnessConfig
    from ray_xlong.rollout.tasks import ArithmeticTask

    torch.manual_seed(args.seed)
    chat = TokenFormat(load_tokenizer(model_dir))
    max_len = 4096
    block = args.block_size
    start = time.perf_counter()
    if engine_name == "vllm":
        from ray_xlong.rollout.vllm_engine import VLLMEngine

        engine = VLLMEngine(model_dir, seed=args.seed, max_model_len=max_len)
        block = int(engine.llm.llm_engine.vllm_config.cache_config.block_size)
    else:
        engine = HFEngine(model_dir, seed=args.seed, max_batch_size=64)
    startup = time.perf_counter() - start
    harness = Harness(engine, chat, config=HarnessConfig(
        max_new_tokens=args.new_tokens, temperature=0.0, max_calls=args.calls, max_retries=0,
        context_capacity=max_len, compaction_budget=max_len - args.new_tokens - 64 - 8,
        max_tool_output_tokens=64, max_run_tokens=1 << 20))
    system = _grow(chat, _DOCS, args.system_tokens, 0)
    envs, groups = [], []
    for i in range(args.runs):
        g = i // args.group_size
        brief = _grow(chat, _BRIEF, args.brief_tokens, g) + f" Group {g}."
        envs.append(SharedPromptTask(ArithmeticTask(args.seed * 1000 + i), system=system,
                                     brief=brief, attempt=i % args.group_size))
        groups.append(f"g{g}")
    start = time.perf_counter()
    results = asyncio.run(harness.run_many(envs, run_ids=[f"r{i}" for i in range(args.runs)],
                                           group_ids=groups))
    wall = time.perf_counter() - start
    stats = engine.stats()
    calls = [c for r in results for c in r.run.calls]
    digest = hashlib.sha256()
    for c in calls:
        digest.update(np.asarray(c.input_ids, np.int64).tobytes() + b"|"
                      + np.asarray(c.output_ids, np.int64).tobytes() + b";")
    expected, ceiling = (sum(x) for x in expected_cached(calls, block))
    first = envs[0].reset()
    return {"engine": engine_name, "runs": args.runs, "calls": len(calls),
            "system_prompt_tokens": int(chat.encode(first.system).size),
            "first_prompt_tokens": int(chat.prompt(first.system, first.prompt).size),
            "max_context_tokens": max(int(np.asarray(c.input_ids).size) for c in calls),
            "output_tokens": stats.output_tokens, "prompt_tokens": stats.prompt_tokens,
            "cached_tokens": stats.cached_tokens, "wall_s": wall, "startup_s": startup,
            "tokens_per_s": stats.output_tokens / wall,
            "prompt_tokens_per_s": stats.prompt_tokens / wall,
            "prefix_hit_rate": stats.prefix_hit_rate,
            "expected_hit_rate": expected / max(stats.prompt_tokens, 1),
            "block_ceiling_hit_rate": ceiling / max(stats.prompt_tokens, 1),
            "block_size": block, "batches": stats.batches, "workload_digest": digest.hexdigest(),
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


_SHAPE = ("runs", "group_size", "calls", "new_tokens", "system_tokens", "brief_tokens", "seed")


def _child(args: argparse.Namespace, engine: str, model_dir: str, block: int) -> dict:
    cmd = [sys.executable, __file__, "--child", engine, "--model-dir", model_dir,
           "--block-size", str(block)]
    for k in _SHAPE:
        cmd += [f"--{k.replace('_', '-')}", str(getattr(args, k))]
    out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        return {"engine": engine, "error": out.stderr.strip().splitlines()[-1:]}
    return json.loads(out.stdout.strip().splitlines()[-1])


KEYS = ["tokens_per_s", "prompt_tokens_per_s", "prefix_hit_rate", "expected_hit_rate",
        "block_ceiling_hit_rate",
        "output_tokens", "prompt_tokens", "cached_tokens", "calls", "wall_s", "startup_s",
        "peak_rss_mib"]


def same_tokens(rows: list[dict]) -> bool | None:
    """Whether every engine that ran saw and produced the same ids (None: fewer than two)."""
    digests = [r["workload_digest"] for r in rows if "error" not in r]
    return len(set(digests)) == 1 if len(digests) > 1 else None


def table(rows: list[dict]) -> str:
    by = {r["engine"]: r for r in rows if "error" not in r}
    lines = ["| metric | " + " | ".join(by) + " | vllm / hf |",
             "|---" * (len(by) + 2) + "|"]
    for k in KEYS:
        ratio = (f"{by['vllm'][k] / by['hf'][k]:.2f}" if {"vllm", "hf"} <= set(by)
                 and by["hf"][k] else "n/a")
        lines.append(f"| {k} | " + " | ".join(f"{r[k]:.3g}" for r in by.values())
                     + f" | {ratio} |")
    if by:
        r = next(iter(by.values()))
        lines.append(f"\nblock size {r['block_size']}; system prompt {r['system_prompt_tokens']} "
                     f"tokens, first prompt {r['first_prompt_tokens']}, longest context "
                     f"{r['max_context_tokens']}")
    if len(by) > 1:
        same = same_tokens(rows)
        lines.append("same tokens on every engine: " + ("yes" if same else
                                                        "NO (greedy outputs diverged)"))
    for r in rows:
        if "error" in r:
            lines.append(f"\n{r['engine']}: failed ({r['error']})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict | None:
    p = bench_parser(__doc__)
    p.add_argument("--runs", type=int, default=16, help="concurrent runs")
    p.add_argument("--group-size", type=int, default=4, help="runs per group (shared brief)")
    p.add_argument("--calls", type=int, default=6, help="model calls (turns) per run")
    p.add_argument("--new-tokens", type=int, default=32, help="most tokens per call")
    p.add_argument("--system-tokens", type=int, default=512,
                   help="length of the shared system prompt (about; whole sections)")
    p.add_argument("--brief-tokens", type=int, default=128,
                   help="length of a group's shared task brief (about)")
    p.add_argument("--engines", default="vllm,hf")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--model-dir", default=None, help=argparse.SUPPRESS)
    p.add_argument("--block-size", type=int, default=DEFAULT_BLOCK, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(measure(args.child, args.model_dir, args)))
        return None
    if args.smoke:
        args.runs, args.group_size, args.calls, args.new_tokens = 2, 2, 2, 8
        args.system_tokens, args.brief_tokens = 160, 16
    if args.runs < 1 or args.group_size < 1 or args.calls < 1 or args.new_tokens < 1:
        p.error("--runs, --group-size, --calls and --new-tokens must be >= 1")
    from ray_xlong.models import build_tiny_model_dir
    from ray_xlong.rollout.vllm_engine import vllm_available

    with tempfile.TemporaryDirectory(prefix="xlong_bench_") as tmp:
        model_dir = str(build_tiny_model_dir(os.path.join(tmp, "model"), seed=args.seed))
        engines = [e for e in args.engines.split(",") if e != "vllm" or vllm_available()]
        engines.sort(key=lambda e: e != "vllm")   # vLLM first: it reports its block size
        rows, block = [], DEFAULT_BLOCK
        for e in engines:
            rows.append(_child(args, e, model_dir, block))
            block = rows[-1].get("block_size", block)
    result = {**{k: getattr(args, k) for k in _SHAPE}, "same_tokens": same_tokens(rows),
              "rows": rows}
    return finish(result, show=lambda r: print(table(r["rows"])), json_path=args.json)


if __name__ == "__main__":
    main()
