"""Tiny-budget smoke run of benchmarks/learner_step.py: the product Learner trains tree batches
with ``xlong_tree`` by default, and its tree step gives the per-trajectory gradient."""

from __future__ import annotations

import importlib.util
import json
import pathlib

import pytest

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "learner_step.py"


@pytest.mark.benchmark
@pytest.mark.rllib
@pytest.mark.slow
def test_learner_step_smoke(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("learner_step_bench", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
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
