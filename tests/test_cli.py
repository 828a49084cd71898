"""Smoke tests of every ``ray-xlong`` command (run in-process through ``main``)."""

from __future__ import annotations

import json

import pytest

from ray_xlong.cli import main


@pytest.fixture
def runs_file(tmp_path):
    path = tmp_path / "runs.jsonl"
    assert main(["synth", "--out", str(path), "--groups", "2", "--runs-per-group", "2"]) == 0
    return path


def test_synth_and_inspect(runs_file, capsys):
    assert main(["inspect", str(runs_file), "--max-trajectories", "3"]) == 0
    out = capsys.readouterr().out
    assert out.count("# run g") == 4 and "PrefixTree(run=" in out and "dedup" in out


def test_inspect_one_run_without_tree(runs_file, capsys):
    assert main(["inspect", str(runs_file), "--run", "g1r0", "--no-tree"]) == 0
    out = capsys.readouterr().out
    assert "# run g1r0" in out and "# run g0r0" not in out and "PrefixTree" not in out


@pytest.mark.slow
def test_inspect_paper_run_prints_five_kept_trajectories(tmp_path, capsys):
    path = tmp_path / "paper.jsonl.gz"
    assert main(["synth", "--paper", "--out", str(path)]) == 0
    assert main(["inspect", str(path), "--tree-tokens", "4"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines()
            if line.startswith("  | ") and "| kind |" not in line and "---" not in line]
    kept = [r for r in rows if not r.startswith("  | dropped")]
    assert len(kept) == 5 and all(" main " in r or " summary " in r or " subagent " in r
                                  for r in kept)


def test_sim_writes_event_logs_and_timeline_draws_them(tmp_path, capsys):
    events = tmp_path / "events"
    assert main(["sim", "--steps", "2", "--modes", "colocated", "elastic",
                 "--events-dir", str(events)]) == 0
    assert "| elastic |" in capsys.readouterr().out
    png = tmp_path / "t.png"
    assert main(["timeline", str(events / "elastic.jsonl"), str(events / "colocated.jsonl"),
                 "--out", str(png)]) == 0
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_bench_sim_prints_ratios_vs_elastic_and_writes_json(tmp_path, capsys):
    out, events = tmp_path / "bench.json", tmp_path / "ev"
    assert main(["bench", "--steps", "2", "--forecast", "--json", str(out),
                 "--events-dir", str(events)]) == 0
    table = capsys.readouterr().out
    assert "| mode | makespan h | ÷ elastic |" in table and "| forecast |" in table
    data = json.loads(out.read_text())
    assert data["backend"] == "sim" and data["steps"] == 2
    assert list(data["modes"]) == ["colocated", "async", "elastic", "forecast"]
    assert data["modes"]["elastic"]["vs_elastic"] == 1.0
    for row in data["modes"].values():
        assert row["makespan_h"] >= data["lower_bound_h"] > 0
    png = tmp_path / "t.png"
    assert main(["timeline", str(events / "forecast.jsonl"), "--out", str(png)]) == 0
    assert png.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("argv, message", [
    pytest.param(["inspect", "/no/such.jsonl"], "no such file", id="missing-file"),
    pytest.param(["sim", "--preset", "paper-9t"], "paper-9t", id="unknown-preset"),
    pytest.param(["sim", "--modes", "turbo"], "unknown mode", id="unknown-mode"),
    pytest.param(["bench", "--modes", "async", "colocated"], "include elastic",
                 id="bench-without-elastic"),
    pytest.param(["bench", "--modes", "elastic", "turbo"], "unknown mode",
                 id="bench-unknown-mode"),
    pytest.param(["bench", "--size", "smoke"], "--backend ray", id="bench-size-on-sim"),
    pytest.param(["bench", "--steps", "0"], "argument --steps: must be an int >= 1",
                 id="bench-zero-steps"),
    pytest.param(["bench", "--backend", "ray", "--steps", "2"], "--backend sim",
                 id="bench-steps-on-ray"),
])
def test_errors_say_what_to_change(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_timeline_rejects_a_non_event_file(runs_file, tmp_path, capsys):
    assert main(["timeline", str(runs_file), "--out", str(tmp_path / "x.png")]) == 2
    assert "not an event log" in capsys.readouterr().err


def test_every_command_has_help(capsys):
    for command in ("synth", "inspect", "sim", "bench", "timeline", "train"):
        with pytest.raises(SystemExit) as exit_:
            main([command, "--help"])
        assert exit_.value.code == 0
    assert "usage" in capsys.readouterr().out
