"""Print the ``uv pip install`` flags that mirror pip's own configuration, one per line.

``make setup`` installs with uv (the same releases as pip, in a fraction of the time: a fresh
environment took ~5 min with pip and ~25 s with uv on a 2-core VM). uv does not read pip's
configuration, so this reads it the way pip does (``pip config list``: its files and ``PIP_*``
variables, the variables winning) and turns ``find-links``, ``index-url``,
``extra-index-url`` and ``constraint`` into uv's flags. With several indexes uv would take a
package from the first index that has it; ``--index-strategy unsafe-best-match`` keeps pip's
rule (the best version across all of them).

    python .ci/uv_flags.py          # run with the environment's python: its pip's view
"""

from __future__ import annotations

import ast
import subprocess
import sys

FLAGS = {"find-links": "--find-links", "index-url": "--index-url",
         "extra-index-url": "--extra-index-url", "constraint": "--constraints"}
"""pip option -> uv flag (each value of a space-separated list gets its own flag)."""


def pip_settings(listing: str) -> dict[str, str]:
    """The options ``FLAGS`` names from ``pip config list`` output; a ``PIP_*`` variable
    (``:env:.name``) wins over a file's ``global.name`` / ``install.name``."""
    out: dict[str, tuple[int, str]] = {}
    for line in listing.splitlines():
        key, sep, raw = line.partition("=")
        section, _, name = key.rpartition(".")
        if not sep or name not in FLAGS or section not in (":env:", "global", "install"):
            continue
        rank = {"global": 0, "install": 1, ":env:": 2}[section]
        if name not in out or rank >= out[name][0]:
            out[name] = (rank, ast.literal_eval(raw))
    return {name: value for name, (_, value) in out.items()}


def uv_flags(settings: dict[str, str]) -> list[str]:
    """uv flags for ``settings`` (``pip_settings``), pip's index rule included."""
    flags: list[str] = []
    for name, value in settings.items():
        for item in value.split():
            flags += [FLAGS[name], item]
    return flags + ["--index-strategy", "unsafe-best-match"]


def main() -> int:
    listing = subprocess.run([sys.executable, "-m", "pip", "config", "list"],
                             capture_output=True, text=True, check=False).stdout
    print("\n".join(uv_flags(pip_settings(listing))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
