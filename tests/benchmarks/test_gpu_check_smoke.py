"""benchmarks/gpu_check.py --device cpu: every stage of the GPU check runs at tiny size on CPU
(several engines serving runs, sleep / wake, weight reload, tree vs per-trajectory step, a
2-rank FSDP2 cell on gloo, a 2-cell elastic step whose weights equal the 1-cell step's)."""

from __future__ import annotations

import importlib.util
import json
import pathlib
import sys

import pytest

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_check.py"


@pytest.mark.benchmark
@pytest.mark.ray
@pytest.mark.slow          # ~2-4 min on the shared 2-core machine (4 Ray actors start)
def test_gpu_check_cpu_smoke(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("gpu_check_bench", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod                 # its dataclass looks its module up
    spec.loader.exec_module(mod)
    out = tmp_path / "out.json"
    mod.main(["--device", "cpu", "--seed", "0", "--json", str(out)])
    stages = json.loads(out.read_text())["stages"]
    assert list(stages) == ["engine", "sleep_wake", "weight_reload", "tree_step", "fsdp_step",
                            "elastic_2cell"]
    assert all(s["ok"] for s in stages.values()), {k: s.get("error") for k, s in stages.items()}
    assert stages["engine"]["runs_per_engine"] == [2, 2]
    assert stages["fsdp_step"]["ranks"] == 2 and stages["fsdp_step"]["micro_batches"] > 1
    assert stages["elastic_2cell"]["joined_at_micro_batch"] > 0
    assert stages["elastic_2cell"]["rel_diff_vs_fsdp_step"] < 1e-5
    assert "| fsdp_step | yes |" in capsys.readouterr().out
