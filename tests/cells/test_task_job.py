"""The warm-started policy cache of ``task_job``: one directory per seed and warm-start config,
reused once finished, with the warm start's report next to the model."""

from __future__ import annotations

import json
import pathlib

import pytest

pytest.importorskip("ray")

from ray_xlong.cells.task_job import (READY_MARKER, REPORT,  # noqa: E402
                                      warm_started_model_dir)
from ray_xlong.rollout.lookup_recipe import WarmStartConfig  # noqa: E402

TINY = WarmStartConfig(clean_steps=2, noisy_steps=1, min_accuracy=0.0, check_demonstrations=4)
"""A plumbing-only warm start (no check): seconds, not a usable policy."""


@pytest.mark.slow
def test_cache_is_keyed_by_seed_and_warm_start_config(tmp_path):
    first = pathlib.Path(warm_started_model_dir(tmp_path, seed=0, warm=TINY))
    stamp = (first / READY_MARKER).stat().st_mtime_ns
    assert warm_started_model_dir(tmp_path, seed=0, warm=TINY) == str(first)    # reused
    assert (first / READY_MARKER).stat().st_mtime_ns == stamp                   # not rebuilt
    other = warm_started_model_dir(tmp_path, seed=0, warm=WarmStartConfig(
        clean_steps=2, noisy_steps=2, min_accuracy=0.0, check_demonstrations=4))
    assert other != str(first) and first.name.startswith("policy-seed0-")
    report = json.loads((first / REPORT).read_text())
    assert (report["clean_steps"], report["noisy_steps"], len(report["losses"])) == (2, 1, 3)
    assert set(report["final_clean"]) == {"accuracy", "answer_accuracy", "right_key_prob"}


def test_failed_warm_start_is_not_cached(tmp_path):
    from ray_xlong.rollout.lookup_recipe import WarmStartFailed

    failing = WarmStartConfig(clean_steps=1, check_steps=1, max_clean_steps=1, noisy_steps=0,
                              check_demonstrations=4)
    with pytest.raises(WarmStartFailed, match="seed 0"):
        warm_started_model_dir(tmp_path, seed=0, warm=failing)
    assert not list(tmp_path.glob(f"*/{READY_MARKER}"))


@pytest.mark.slow
def test_template_policy_has_its_own_cache_entry_and_chat_format(tmp_path):
    from ray_xlong.rollout.formats import load_chat_format
    from ray_xlong.rollout.template_format import TemplateFormat

    token = warm_started_model_dir(tmp_path, seed=0, warm=TINY)
    chatml = pathlib.Path(warm_started_model_dir(tmp_path, seed=0, warm=TINY,
                                                 style="chatml_tiny"))
    assert str(chatml) != token and chatml.name.startswith("policy-seed0-chatml_tiny-")
    fmt = load_chat_format(chatml)
    assert isinstance(fmt, TemplateFormat) and fmt.parser.name == "hermes"
    assert json.loads((chatml / "xlong_chat.json").read_text())["format"] == "template"


def _make_agent(seed: int):
    return seed


def test_an_external_agent_task_is_registered_under_its_own_name():
    from ray_xlong.cells.task_job import TaskJob
    from ray_xlong.rllib.algorithm_config import XLongOptions

    job = TaskJob("my-agent", seed=3, agent=_make_agent)
    assert job.agent_tasks() == {"my-agent": _make_agent} and job.tasks() == {}
    assert job.spec(9, runs_per_group=4).task == "my-agent"
    assert TaskJob("lookup").agent_tasks() == {}
    with pytest.raises(ValueError, match="not a built-in task"):
        TaskJob("lookup", agent=_make_agent)             # the agent needs a name of its own
    with pytest.raises(ValueError, match="XLongOptions.task"):
        XLongOptions(task="lookup", agent_task=_make_agent)
    with pytest.raises(ValueError, match="XLongOptions.agent_task"):
        XLongOptions(task="my-agent", agent_task="not callable")
    assert XLongOptions(task="my-agent", agent_task=_make_agent).agent_task is _make_agent
