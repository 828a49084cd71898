"""The layers of docs/design.md: imports only point down.

```
jobs/           whole jobs (train, driver, modes)  may import everything below
rllib/          the RLlib adapter                 cells and below
cells/          the cell runtime on Ray           serving, rollout, models and the pure core;
                                                  no ray.rllib
serving/        a cell's OpenAI endpoint          rollout, models, trajectory; no ray.rllib
viewer/         the run viewer (HTML)             models, trajectory
rollout/        engines, harness, tasks           models, trajectory
models/         local models, tokenizers          trajectory
sim/            simulator (pure)                  scheduling
scheduling/     cell machine + policies (pure)    nothing of ours
trajectory/     records → packing (pure)          nothing of ours
```

Checked statically (every import statement of every module, those inside functions and under
``TYPE_CHECKING`` included), no import cycle between the modules of one package, and, for the
pure packages and ``cells/``, dynamically (importing every module in a fresh interpreter leaves the forbidden
packages out of ``sys.modules``). Each package's ``__init__`` opens with a docstring saying what
lives there and what it may import.
"""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "ray_xlong"
PURE = ["trajectory", "scheduling", "sim"]
FORBIDDEN = {pkg: ("ray", "vllm") for pkg in PURE} | {"cells": ("ray.rllib", "vllm"),
                                                       "serving": ("ray.rllib",),
                                                       "viewer": ("ray", "vllm")}
"""Third-party modules (dotted prefixes) a package must not import."""
MAY_IMPORT: dict[str, set[str]] = {
    "trajectory": set(),
    "scheduling": set(),
    "sim": {"scheduling"},
    "models": {"trajectory"},
    "rollout": {"models", "trajectory"},
    "serving": {"rollout", "models", "trajectory"},
    "viewer": {"models", "trajectory"},
    "cells": {"serving", "rollout", "models", "trajectory", "scheduling", "sim"},
    "rllib": {"cells", "serving", "rollout", "models", "trajectory", "scheduling", "sim"},
    "jobs": {"rllib", "cells", "serving", "rollout", "models", "trajectory", "scheduling",
              "sim"},
}
"""Our packages each package may import (besides itself and the top-level ``checks``)."""
BOTTOM = {"checks"}
"""Top-level modules every layer may use (no imports of ours)."""


def _files(pkg: str):
    return sorted((PACKAGE / pkg).rglob("*.py"))


def _imports(path: pathlib.Path) -> set[str]:
    """Dotted names of every absolute import in ``path`` (``from a.b import c`` → ``a.b.c``
    and ``a.b``)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.add(node.module)
            out |= {f"{node.module}.{alias.name}" for alias in node.names}
    return out


def _params(packages):
    return [pytest.param(pkg, path, id=str(path.relative_to(ROOT)))
            for pkg in packages for path in _files(pkg)]


def _matches(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def test_every_package_has_a_layer():
    found = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    assert found == set(MAY_IMPORT), "a package without a layer in MAY_IMPORT (or a stale one)"


@pytest.mark.parametrize("pkg, path", _params(sorted(FORBIDDEN)))
def test_no_forbidden_third_party_import(pkg, path):
    bad = {n for n in _imports(path) for f in FORBIDDEN[pkg] if _matches(n, f)}
    assert not bad, f"{path.relative_to(ROOT)} ({pkg}/) imports {sorted(bad)}"


@pytest.mark.parametrize("pkg, path", _params(sorted(MAY_IMPORT)))
def test_imports_only_point_down(pkg, path):
    ours = {n.split(".")[1] for n in _imports(path) if _matches(n, "ray_xlong") and "." in n}
    upward = ours - MAY_IMPORT[pkg] - BOTTOM - {pkg}
    assert not upward, (f"{path.relative_to(ROOT)} ({pkg}/) imports {sorted(upward)}; "
                        f"{pkg}/ may import {sorted(MAY_IMPORT[pkg])}")


@pytest.mark.parametrize("pkg", sorted(MAY_IMPORT))
def test_package_docstring_says_what_lives_there(pkg):
    doc = ast.get_docstring(ast.parse((PACKAGE / pkg / "__init__.py").read_text()))
    assert doc and "import" in doc.lower(), f"ray_xlong/{pkg}/__init__.py: no docstring saying " \
                                            "what lives there and what it may import"


@pytest.mark.parametrize("pkg", sorted(FORBIDDEN))
def test_importing_the_package_loads_nothing_forbidden(pkg):
    modules = []
    for path in _files(pkg):
        parts = [p for p in path.relative_to(ROOT).with_suffix("").parts if p != "__init__"]
        modules.append(".".join(parts))
    code = (
        "import importlib, sys\n"
        f"for m in {modules!r}:\n"
        "    importlib.import_module(m)\n"
        f"bad = sorted(m for m in sys.modules if any(m == f or m.startswith(f + '.') "
        f"for f in {FORBIDDEN[pkg]!r}))\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "", f"{pkg}/ pulled in: {out.stdout.strip()[:300]}"


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _module_graph(pkg: str) -> dict[str, set[str]]:
    """Module → the modules of the same package it imports (anywhere in its body)."""
    mods = {_module_name(p): p for p in _files(pkg)}
    graph = {}
    for name, path in mods.items():
        deps = set()
        for dotted in _imports(path):
            while dotted and dotted not in mods:
                dotted = dotted.rpartition(".")[0]
            if dotted and dotted != name and dotted != f"ray_xlong.{pkg}":
                deps.add(dotted)
        graph[name] = deps
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` (a → b → … → a), or None (depth-first search)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start)):
            return found
    return None


def test_cycle_finder_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


@pytest.mark.parametrize("pkg", sorted(MAY_IMPORT))
def test_no_import_cycle_inside_a_package(pkg):
    """The package's ``__init__`` re-exports its modules and is left out; between the modules
    themselves imports form no cycle (deferred imports inside functions count too)."""
    cycle = _cycle(_module_graph(pkg))
    assert cycle is None, f"ray_xlong/{pkg}/: import cycle {' -> '.join(cycle)}"


@pytest.mark.parametrize("path", sorted(PACKAGE.rglob("*.py")), ids=lambda p: str(p.relative_to(ROOT)))
def test_the_product_never_imports_the_benchmark_tooling(path):
    bad = {n for n in _imports(path) if _matches(n, "benchmarks") or _matches(n, "tests")}
    assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)} (tooling, not the product)"
