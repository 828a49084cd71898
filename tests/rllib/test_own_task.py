"""A team's own task through the config (no Ray started): a name registered in this process or a
factory reaches the cell layer's job (``TaskJob.tasks()``, what every runner registers), a name
unknown here is refused at ``.xlong()`` before anything starts, and the factory survives the
pickling Tune and checkpoints do. Evaluation settings xlong cannot run are refused by name."""

from __future__ import annotations

import pickle

import pytest

pytest.importorskip("ray")

import ray_xlong  # noqa: E402
from ray.rllib.algorithms.ppo import PPOConfig  # noqa: E402
from ray_xlong.rllib.algorithm_config import XLongConfig  # noqa: E402
from ray_xlong.rollout.tasks import (TASKS, DatasetTask, LookupTask, PromptEnv,  # noqa: E402
                                     register_task)


class Riddle(LookupTask):
    """A user's task (a subclass is enough for the plumbing checked here)."""


@pytest.fixture
def registered():
    register_task("riddle", Riddle)
    yield "riddle"
    TASKS.pop("riddle")


def job_tasks(config: XLongConfig) -> dict:
    return config.xlong(model_dir="/m").job_config(group_offset=0).work.tasks()


def test_a_name_registered_here_travels_to_the_cells(registered):
    config = XLongConfig().xlong(task=registered)
    assert config.xlong_options.task_name == "riddle"
    assert job_tasks(config) == {"riddle": Riddle}


def test_a_factory_travels_under_its_name():
    config = XLongConfig().xlong(task=Riddle)
    assert config.xlong_options.task_name == f"{__name__}.Riddle"
    assert job_tasks(config) == {f"{__name__}.Riddle": Riddle}
    spec = config.xlong(model_dir="/m").job_config(group_offset=0).work.spec(0, runs_per_group=8)
    assert spec.task == f"{__name__}.Riddle"


def test_a_dataset_task_is_named_by_its_name():
    task = DatasetTask([{"prompt": "hi", "answer": "hi"}], env=PromptEnv.factory(), name="qa")
    assert job_tasks(XLongConfig().xlong(task=task, eval_task=task)) == {"qa": task}


def test_a_built_in_task_sends_nothing():
    assert job_tasks(XLongConfig().xlong(task="lookup")) == {}


def test_enable_takes_a_factory_too():
    config = ray_xlong.enable(PPOConfig().training(train_batch_size_per_learner=16),
                              runs_per_group=8, task=Riddle)
    assert job_tasks(config) == {f"{__name__}.Riddle": Riddle}


@pytest.mark.parametrize("field", ["task", "eval_task"])
def test_an_unknown_name_is_refused_before_anything_starts(field):
    with pytest.raises(ValueError, match=rf"XLongOptions.{field} must be a registered task "
                                         r"name .*'arithmetic'"):
        XLongConfig().xlong(**{field: "chess"})


def test_a_factory_named_like_a_built_in_task_is_refused():
    def lookup(seed):
        return Riddle(seed)

    lookup.name = "lookup"
    with pytest.raises(ValueError, match="XLongOptions.task"):
        XLongConfig().xlong(task=lookup)


def test_the_resolved_factory_survives_pickling_where_the_name_is_unknown(registered):
    config = XLongConfig().xlong(task=registered, model_dir="/m")
    blob = pickle.dumps(config.xlong_options)
    TASKS.pop("riddle")                     # another process: the name is not registered
    try:
        options = pickle.loads(blob)
        assert options.task_factory is Riddle
        again = XLongConfig()
        again.xlong_options = options
        assert again.xlong(runs_per_group=8).job_config(group_offset=0).work.tasks() \
            == {"riddle": Riddle}
    finally:
        TASKS["riddle"] = Riddle


def test_a_new_task_resolves_afresh(registered):
    config = XLongConfig().xlong(task=registered).xlong(task="lookup")
    assert config.xlong_options.task_factory is None


@pytest.mark.parametrize("settings,field", [
    pytest.param(dict(evaluation_duration="auto", evaluation_parallel_to_training=True,
                      evaluation_num_env_runners=1),
                 "evaluation_duration", id="auto"),
    pytest.param(dict(evaluation_duration_unit="timesteps"), "evaluation_duration_unit",
                 id="timesteps"),
])
def test_evaluation_settings_xlong_cannot_run_are_named(settings, field):
    config = XLongConfig().xlong(model_dir="/m").evaluation(evaluation_interval=2, **settings)
    with pytest.raises(ValueError, match=f"XLongConfig.{field}"):
        config.validate()


def test_eval_samples_is_checked():
    with pytest.raises(ValueError, match="XLongOptions.eval_samples"):
        XLongConfig().xlong(eval_samples=0)
