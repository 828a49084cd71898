"""A 20-turn tool-calling run on the template path is ONE main trajectory (+ its subagent's),
and ``ray-xlong inspect`` prints the count."""

from __future__ import annotations

import asyncio

import pytest

from ray_xlong import cli
from ray_xlong.models.tokenizer import build_tokenizer
from ray_xlong.rollout import Harness, HarnessConfig, ScriptedEngine
from ray_xlong.rollout.template_format import TemplateFormat
from ray_xlong.trajectory import ProcessorConfig, TrajectoryProcessor
from ray_xlong.trajectory.recording import write_runs
from tests.rollout.test_template_format import TwoTools, policy


@pytest.mark.parametrize("style", ["chatml", "llama3"])
def test_twenty_turn_run_is_one_main_trajectory_and_inspect_prints_it(style, tmp_path, capsys):
    fmt = TemplateFormat(build_tokenizer(style=style, vocab_size=600))
    engine = ScriptedEngine(policy(fmt, turns=20), vocab_size=len(fmt.tokenizer))
    cfg = HarnessConfig(max_new_tokens=64, max_calls=40, context_capacity=8192,
                        compaction_budget=6000)
    result = asyncio.run(Harness(engine, fmt, config=cfg).run(TwoTools(), run_id="r20",
                                                              group_id="g"))
    run = result.run
    main_calls = [c for c in run.calls if c.agent_id == "main"]
    assert run.status == "finished" and len(main_calls) == 21 and result.info.compactions == 0
    batch = TrajectoryProcessor(ProcessorConfig(pack="none")).process([run])
    kinds = sorted(t.kind for t in batch.trajectories)
    assert kinds == ["main", "subagent"]                  # 21 main calls: one trajectory
    path = tmp_path / "runs.jsonl"
    write_runs(str(path), [run])
    assert cli.main(["inspect", str(path), "--no-tree"]) == 0
    out = capsys.readouterr().out
    assert "trajectories: 2 kept (main 1, subagent 1), 0 dropped" in out
    assert "2 trajectories kept, 0 dropped" in out
