"""benchmarks/gpu_check.py --device cpu: every stage of the GPU check runs at tiny size on CPU
(several engines serving runs, sleep / wake, weight reload, tree vs per-trajectory step, a
2-rank FSDP2 cell on gloo, a 2-cell elastic step whose weights equal the 1-cell step's)."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

from tests.shared import load_script

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_check.py"


@pytest.mark.benchmark
@pytest.mark.ray
@pytest.mark.slow          # ~2-4 min on the shared 2-core machine (4 Ray actors start)
def test_gpu_check_cpu_smoke(tmp_path, capsys):
    mod = load_script(SCRIPT, "gpu_check_bench", register=True)
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


BLOCKER = '''
import sys


class _Blocked:
    """Refuses ray and vllm: gpu_check --torch-only must run where neither is installed."""

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("ray", "vllm"):
            raise ImportError(f"{name} is blocked for gpu_check --torch-only")
        return None


sys.meta_path.insert(0, _Blocked())
'''


@pytest.mark.benchmark
@pytest.mark.slow          # ~1 min on the shared 2-core machine (two spawned ranks)
def test_gpu_check_torch_only_runs_with_ray_and_vllm_blocked(tmp_path):
    """``--device cpu --torch-only`` with ``import ray`` / ``import vllm`` refused in every
    process (a sitecustomize on PYTHONPATH reaches the spawned ranks too): every stage passes
    and the JSON holds each stage's findings."""
    import os
    import subprocess

    root = SCRIPT.parents[1]
    (tmp_path / "block").mkdir()
    (tmp_path / "block" / "sitecustomize.py").write_text(BLOCKER)
    env = {**os.environ, "PYTHONPATH": f"{tmp_path / 'block'}{os.pathsep}{root}"}
    refused = subprocess.run([sys.executable, "-c", "import ray"], env=env,
                             capture_output=True, text=True)
    assert refused.returncode != 0 and "blocked" in refused.stderr     # the blocker works
    out = tmp_path / "torch_only.json"
    done = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--torch-only",
                           "--json", str(out)], env=env, capture_output=True, text=True,
                          cwd=tmp_path, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(out.read_text())
    stages = result["stages"]
    assert result["torch_only"] is True
    assert list(stages) == ["tree_attention", "tree_scaling", "learner_rank", "two_ranks",
                            "versions"]
    assert all(s["ok"] for s in stages.values()), {k: s.get("error") for k, s in stages.items()}
    assert stages["tree_attention"]["fp32_xlong_tree_dlogp"] < 1e-4
    assert {"256_xlong_tree_s", "1024_dense_s", "1024_per_trajectory_maxdiff"} <= set(
        stages["tree_scaling"])
    assert stages["learner_rank"]["weights_kept"] is True
    ranks = stages["two_ranks"]
    assert ranks["grad_rel_diff"] < 1e-4 and ranks["stream_sync_ok"] and ranks["survived"]
    assert ranks["groups_aborted"] == 1 and ranks["lost_peer_error"]
    assert stages["versions"]["torch"] == torch_version()
    assert "| two_ranks | yes |" in done.stdout


def torch_version() -> str:
    import torch

    return torch.__version__


def test_the_learner_rank_settings_import_no_ray():
    """The torch-only stages give ``LearnerRank`` the product's own ``LearnerSettings``
    (``cells/learner_settings.py``): importing it and the rank loads neither Ray nor vLLM."""
    code = ("import sys\n"
            "from ray_xlong.cells.learner_settings import LearnerSettings\n"
            "from ray_xlong.cells.sharded import LearnerRank\n"
            "LearnerSettings('m', context_parallel=1)\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('ray', 'vllm')))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=SCRIPT.parents[1], timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]", out.stdout

