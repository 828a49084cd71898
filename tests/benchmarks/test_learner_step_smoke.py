"""Tiny-budget smoke run of benchmarks/learner_step.py: the product Learner trains tree batches
with ``xlong_tree`` by default, and its tree step gives the per-trajectory gradient."""

from __future__ import annotations

import json
import pathlib

import pytest

from tests.shared import load_script

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "learner_step.py"


@pytest.mark.benchmark
@pytest.mark.rllib
@pytest.mark.slow
def test_learner_step_smoke(tmp_path, capsys):
    mod = load_script(SCRIPT, "learner_step_bench")
    out = tmp_path / "out.json"
    mod.main(["--smoke", "--seed", "1", "--dense", "--json", str(out)])
    data = json.loads(out.read_text())
    variants = data["variants"]
    assert variants["tree"]["attn"] == "xlong_tree"          # the product default
    assert variants["tree_dense"]["attn"] == "sdpa"
    assert data["unique_tokens"] < data["total_tokens"]
    assert all(v["step_s"] > 0 for v in variants.values())
    assert data["grad_rel_diff"] < 1e-4                      # same update, fp32
    assert "ratio to bound" in capsys.readouterr().out
