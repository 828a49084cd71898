"""Every ``ray-xlong`` command checks its arguments before it starts Ray or builds a model: a
bad argument exits with status 2 and a message naming it. The table below is the contract
(``cli_args.py``; README "The ray-xlong command line")."""

from __future__ import annotations

import subprocess
import sys

import pytest

from ray_xlong.cli import main

A_FILE = __file__           # an existing file where a directory (or a file's folder) is wanted

BAD_ARGUMENTS = [
    # command, argv, what the message must say
    pytest.param(["synth", "--out", "r.jsonl", "--groups", "0"], "argument --groups",
                 id="synth-groups-0"),
    pytest.param(["synth", "--out", "r.jsonl", "--runs-per-group", "-1"],
                 "argument --runs-per-group", id="synth-runs-per-group-neg"),
    pytest.param(["synth", "--out", "r.txt"], "argument --out: must end in .jsonl",
                 id="synth-out-suffix"),
    pytest.param(["synth", "--out", f"{A_FILE}/r.jsonl"], "argument --out: cannot write",
                 id="synth-out-under-a-file"),
    pytest.param(["inspect", "/no/such.jsonl"], "argument runs: no such file",
                 id="inspect-missing-runs"),
    pytest.param(["inspect", A_FILE, "--max-trajectories", "0"], "argument --max-trajectories",
                 id="inspect-k-0"),
    pytest.param(["inspect", A_FILE, "--tree-tokens", "x"], "argument --tree-tokens",
                 id="inspect-tree-tokens-text"),
    pytest.param(["inspect", A_FILE, "--html", "out.txt"], "argument --html: must end in .html",
                 id="inspect-html-suffix"),
    pytest.param(["inspect", A_FILE, "--tokenizer", "/no/such/dir"],
                 "argument --tokenizer: no such directory", id="inspect-tokenizer-missing"),
    pytest.param(["sim", "--steps", "0"], "argument --steps", id="sim-steps-0"),
    pytest.param(["sim", "--seed", "-3"], "argument --seed", id="sim-seed-neg"),
    pytest.param(["sim", "--events-dir", A_FILE], "argument --events-dir: ",
                 id="sim-events-dir-file"),
    pytest.param(["bench", "--steps", "-1"], "argument --steps", id="bench-steps-neg"),
    pytest.param(["bench", "--size", "huge"], "argument --size: invalid choice",
                 id="bench-size-unknown"),
    pytest.param(["bench", "--json", "out.csv"], "argument --json: must end in .json",
                 id="bench-json-suffix"),
    pytest.param(["timeline", "/no/such.jsonl", "--out", "t.png"], "argument events: no such file",
                 id="timeline-missing-log"),
    pytest.param(["timeline", A_FILE, "--out", "t.jpg"], "argument --out: must end in .png",
                 id="timeline-out-suffix"),
    pytest.param(["serve", "--model-dir", "/no/such/dir"],
                 "argument --model-dir: no such directory", id="serve-model-dir-missing"),
    pytest.param(["serve", "--model-dir", "/tmp", "--port", "70000"],
                 "argument --port: must be a TCP port", id="serve-port-too-large"),
    pytest.param(["serve", "--model-dir", "/tmp", "--port", "-1"], "argument --port",
                 id="serve-port-neg"),
    pytest.param(["serve", "--model-dir", "/tmp", "--engine", "tgi"],
                 "argument --engine: invalid choice", id="serve-engine-unknown"),
    pytest.param(["train", "--steps", "0"], "argument --steps: must be an int >= 1",
                 id="train-steps-0"),
    pytest.param(["train", "--steps", "-1"], "argument --steps: must be an int >= 1",
                 id="train-steps-neg"),
    pytest.param(["train", "--groups", "0"], "argument --groups", id="train-groups-0"),
    pytest.param(["train", "--runs-per-group", "0"], "argument --runs-per-group",
                 id="train-runs-per-group-0"),
    pytest.param(["train", "--seed", "-1"], "argument --seed", id="train-seed-neg"),
    pytest.param(["train", "--mode", "turbo"], "argument --mode: invalid choice",
                 id="train-mode-unknown"),
    pytest.param(["train", "--engine", "tgi"], "argument --engine: invalid choice",
                 id="train-engine-unknown"),
    pytest.param(["train", "--out", A_FILE], "argument --out: ", id="train-out-is-a-file"),
    pytest.param(["train", "--config", "/no/such.yaml"], "argument --config: no such file",
                 id="train-config-missing"),
    pytest.param(["train", "--set", "steps=3"], "argument --set: expected section.field=value",
                 id="train-set-no-section"),
    pytest.param(["train", "--set", "xlong.mode=turbo"], "xlong.mode: XLongOptions.mode",
                 id="train-set-bad-value"),
    pytest.param(["train", "--set", "xlong.modes=async"], "xlong.modes: unknown field (did you "
                 "mean 'mode'?)", id="train-set-unknown-field"),
    pytest.param(["train", "--set", "training.lr=fast"], "training.lr must be float",
                 id="train-set-wrong-type"),
    pytest.param(["train", "--groups", "3", "--set", "training.train_batch_size_per_learner=12",
                  "--runs-per-group", "5"], "must be a multiple of xlong.runs_per_group",
                 id="train-batch-not-multiple"),
    pytest.param(["train", "--tracker", "comet"], "argument --tracker: invalid choice",
                 id="train-tracker-unknown"),
]


@pytest.mark.parametrize("argv, message", BAD_ARGUMENTS)
def test_a_bad_argument_exits_2_naming_it(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err, err


def test_train_steps_0_exits_before_importing_ray_or_torch():
    code = ("import sys; from ray_xlong.cli import main; rc = main(['train', '--steps', '0']); "
            "print(rc, 'ray' in sys.modules, 'torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert done.stdout.split() == ["2", "False", "False"], done
    assert "argument --steps: must be an int >= 1, got '0'" in done.stderr


def test_a_bad_config_value_exits_before_starting_ray(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("run:\n  steps: 2\nxlong:\n  engine: tgi\n")
    code = (f"import sys; from ray_xlong.cli import main; rc = main(['train', '--config', "
            f"{str(cfg)!r}]); import ray; print(rc, ray.is_initialized())")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.stdout.split() == ["2", "False"], done
    assert f"{cfg}:4: xlong.engine: XLongOptions.engine must be one of" in done.stderr
