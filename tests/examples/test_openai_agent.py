"""examples/openai_agent.py end to end on 2 elastic cells (tiny budget): the openai agent's runs
are trained and the summary names the job."""

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
def test_openai_agent_example_trains_on_elastic_cells(tmp_path, warm_cache):
    env = dict(os.environ, RAY_TMPDIR=tempfile.mkdtemp(prefix="rx", dir="/tmp"))
    out = subprocess.run([sys.executable, "examples/openai_agent.py", "--smoke", "--workdir",
                          str(warm_cache), "--json", str(tmp_path / "curve.json")],
                         cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "step   2  reward" in out.stdout and "elastic on hf, seed 1" in out.stdout
    curve = json.loads((tmp_path / "curve.json").read_text())
    assert len(curve["rewards"]) == 2 and curve["runs"] == 8
