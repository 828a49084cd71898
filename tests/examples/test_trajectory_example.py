"""The README's first example runs and shows a tree, the stats and equal losses."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_trajectory_connector_alone_example():
    out = subprocess.run([sys.executable, "examples/trajectory_connector_alone.py", "--seed", "1"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "PrefixTree(run=" in out.stdout and "trajectories_kept" in out.stdout
    losses = re.findall(r"loss=([0-9.\-e]+)", out.stdout)
    assert len(losses) == 2 and abs(float(losses[0]) - float(losses[1])) < 1e-9
