"""examples/own_task.py end to end (tiny model): a task of the script trains 2 steps by name and
2 steps by factory (a JSONL dataset), and the second carries RLlib's evaluation block."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import tempfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.ray
@pytest.mark.slow
def test_own_task_example_trains_by_name_and_by_factory(tmp_path):
    env = dict(os.environ, RAY_TMPDIR=tempfile.mkdtemp(prefix="rx", dir="/tmp"))
    out = subprocess.run([sys.executable, "examples/own_task.py", "--json",
                          str(tmp_path / "own.json")],
                         cwd=ROOT, capture_output=True, text=True, timeout=900, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "by name step 2: reward" in out.stdout and "held-out: return" in out.stdout
    data = json.loads((tmp_path / "own.json").read_text())
    assert len(data["by_name"]) == len(data["by_factory"]) == 2
    (ev,) = data["evaluation"]
    assert (ev["num_instances"], ev["num_episodes"]) == (2, 4)
    assert 0.0 <= ev["pass_at_1"] <= ev["pass_at_2"] <= 1.0
