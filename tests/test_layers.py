"""The pure packages import neither ray nor vllm (DESIGN.md, layers).

Checked two ways: statically (no import statement names them) and dynamically (importing every
module of a pure package in a fresh interpreter leaves ``ray`` and ``vllm`` out of sys.modules).
"""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PURE = ["trajectory", "scheduling", "sim"]
FORBIDDEN = {"ray", "vllm"}


def _pure_files():
    for pkg in PURE:
        for path in sorted((ROOT / "ray_xlong" / pkg).rglob("*.py")):
            yield pytest.param(path, id=str(path.relative_to(ROOT)))


def _imported_roots(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.module.split(".")[0]


@pytest.mark.parametrize("path", list(_pure_files()))
def test_pure_module_has_no_forbidden_import(path):
    roots = set(_imported_roots(ast.parse(path.read_text())))
    assert not roots & FORBIDDEN, f"{path} imports {roots & FORBIDDEN}"


def test_importing_pure_packages_loads_no_ray_or_vllm():
    modules = []
    for pkg in PURE:
        base = ROOT / "ray_xlong" / pkg
        for path in sorted(base.rglob("*.py")):
            rel = path.relative_to(ROOT).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            modules.append(".".join(parts))
    code = (
        "import importlib, sys\n"
        f"for m in {modules!r}:\n"
        "    importlib.import_module(m)\n"
        f"bad = sorted(m for m in sys.modules if m.split('.')[0] in {sorted(FORBIDDEN)!r})\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "", f"pure packages pulled in: {out.stdout.strip()}"
