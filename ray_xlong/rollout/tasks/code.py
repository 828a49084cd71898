"""A code task with real tools: write files into a temporary workspace, run pytest on them.

Tools (OpenAI function schemas; arguments as a dict)::

    write(path, content)        write a file inside the workspace (paths may not leave it)
    read(path)                  a file's content
    run_tests()                 ``python -m pytest -q`` in a subprocess, killed after
                                ``test_timeout_s``; its output (the harness truncates it)

The score is the fraction of the task's tests that pass (partial work counts), measured by
running the tests again in ``score``; a hanging solution is killed by the same time limit and
scores 0 for the tests it blocked. The workspace is removed by ``close``.
"""

from __future__ import annotations

import asyncio
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import tempfile

import numpy as np

from ray_xlong.rollout.tasks.base import Observation, ToolError
from ray_xlong.rollout.tool_calls import function_schema

SYSTEM = "Write solution.py in the workspace, then run_tests. Tools: write, read, run_tests."

_FUNCS = {"add": ("a + b", [(1, 2), (3, 4)]), "sub": ("a - b", [(5, 2), (1, 4)]),
          "mul": ("a * b", [(2, 3), (0, 7)]), "maxi": ("max(a, b)", [(2, 9), (8, 1)])}
_OUTCOME = re.compile(r"(\d+) (passed|failed|error)")
MAX_OUTPUT_BYTES = 1 << 20
"""Bytes of test output kept (a flooding solution cannot exhaust memory)."""


class CodeTask:
    """One instance (see module docstring)."""

    tools = (function_schema("write", "Write a file in the workspace.",
                             {"path": {"type": "string"}, "content": {"type": "string"}}),
             function_schema("read", "Read a file of the workspace.", {"path": {"type": "string"}}),
             function_schema("run_tests", "Run the tests; their output.", {}))

    def __init__(self, seed: int, *, test_timeout_s: float = 20.0) -> None:
        rng = np.random.default_rng(seed)
        self.funcs = sorted(rng.choice(sorted(_FUNCS), 2, replace=False).tolist())
        self.test_timeout_s = test_timeout_s
        self.workspace = pathlib.Path(tempfile.mkdtemp(prefix="xlong_code_"))
        self.num_tests = sum(len(_FUNCS[f][1]) for f in self.funcs)
        self.answer: str | None = None

    def reset(self) -> Observation:
        shutil.rmtree(self.workspace / "tests", ignore_errors=True)
        (self.workspace / "tests").mkdir(parents=True)
        lines = ["import sys, pathlib", "sys.path.insert(0, str(pathlib.Path(__file__)"
                 ".parents[1]))", "import solution", ""]
        for f in self.funcs:
            for i, (a, b) in enumerate(_FUNCS[f][1]):
                expected = eval(_FUNCS[f][0], {}, {"a": a, "b": b})  # noqa: S307 - constants
                lines += [f"def test_{f}_{i}():", f"    assert solution.{f}({a}, {b}) == "
                          f"{expected}", ""]
        (self.workspace / "tests" / "test_solution.py").write_text("\n".join(lines))
        specs = ", ".join(f"{f}(a, b) returning {_FUNCS[f][0]}" for f in self.funcs)
        return Observation(SYSTEM, f"Write solution.py defining {specs}.")

    def _path(self, rel: str) -> pathlib.Path:
        path = (self.workspace / rel.strip()).resolve()
        if not rel.strip() or self.workspace.resolve() not in path.parents:
            raise ToolError(f"path {rel.strip()!r} is outside the workspace")
        return path

    async def call_tool(self, name: str, args: dict) -> str:
        if name == "write":
            rel, content = str(args.get("path", "")), str(args.get("content", ""))
            path = self._path(rel)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(content)
            return f"wrote {len(content)} characters to {rel.strip()}"
        if name == "read":
            path = self._path(str(args.get("path", "")))
            if not path.is_file():
                raise ToolError(f"no file {str(args.get('path', '')).strip()!r}")
            return path.read_text()
        if name == "run_tests":
            return await run_pytest(self.workspace, timeout_s=self.test_timeout_s)
        raise ToolError(f"unknown tool {name!r}; tools: write, read, run_tests")

    def submit(self, answer: str) -> None:
        self.answer = answer

    def score(self) -> float:
        """Fraction of tests passing now (runs pytest synchronously)."""
        try:
            out = subprocess.run(_pytest_cmd(), cwd=self.workspace, capture_output=True,
                                 timeout=self.test_timeout_s, text=True, errors="replace")
        except subprocess.TimeoutExpired:
            return 0.0
        return passed_fraction(out.stdout[-4096:], self.num_tests)

    def close(self) -> None:
        shutil.rmtree(self.workspace, ignore_errors=True)


def _pytest_cmd() -> list[str]:
    return [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"]


def passed_fraction(output: str, num_tests: int) -> float:
    """``passed / num_tests`` from a pytest summary line (0 when none is found)."""
    passed = sum(int(n) for n, kind in _OUTCOME.findall(output) if kind == "passed")
    return min(passed, num_tests) / num_tests if num_tests else 0.0


async def run_pytest(workspace: pathlib.Path, *, timeout_s: float) -> str:
    """Run the workspace's tests in a subprocess; kill it after ``timeout_s`` seconds."""
    proc = await asyncio.create_subprocess_exec(
        *_pytest_cmd(), cwd=workspace, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT, start_new_session=True)
    try:
        out = await asyncio.wait_for(_read_capped(proc.stdout), timeout_s)
        if len(out) < MAX_OUTPUT_BYTES:
            await asyncio.wait_for(proc.wait(), timeout_s)
    except asyncio.TimeoutError:
        return f"error: tests killed after {timeout_s:g} s"
    finally:
        if proc.returncode is None:
            try:                             # its own session: kill what the tests spawned too
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            await proc.wait()
    return out.decode(errors="replace")


async def _read_capped(stream: asyncio.StreamReader) -> bytes:
    """Read until EOF or :data:`MAX_OUTPUT_BYTES` (a flooding process is cut off)."""
    chunks, size = [], 0
    while size < MAX_OUTPUT_BYTES:
        chunk = await stream.read(MAX_OUTPUT_BYTES - size)
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks)


def demonstration_calls(task: CodeTask) -> list[tuple[str, dict]]:
    """The ideal tool calls (name, arguments) for scripted policies and warm starts."""
    body = "\n\n".join(f"def {f}(a, b):\n    return {_FUNCS[f][0]}" for f in task.funcs)
    return [("write", {"path": "solution.py", "content": f"{body}\n"}), ("run_tests", {})]
