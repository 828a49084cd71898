"""RLlib's standard result structure and the learner / agent metrics.

* In-process learner: the step's ``policy_loss`` equals the whole batch's normalized loss
  computed at once, the gradient norm is the norm of the reduced gradient before clipping, the
  token statistics count every trained token once.
* ``XLongAlgorithm.train()`` on a local Ray passes RLlib's own
  ``check_train_results_new_api_stack``; every key of the metric table in docs/rllib.md is
  present and finite; lifetime counters add up; RLlib's metrics logger prints no deprecation
  warning.
"""

from __future__ import annotations

import dataclasses
import math
import pathlib
import re

import numpy as np
import pytest
import torch

pytestmark = [pytest.mark.ray, pytest.mark.rllib]
ray = pytest.importorskip("ray")

from ray_xlong.models import build_tiny_model_dir, load_model  # noqa: E402
from ray_xlong.cells.learner_group import plan_step  # noqa: E402
from ray_xlong.rllib.episodes import run_to_episode  # noqa: E402
from ray_xlong.rllib.learner import LearnerSettings, XLongLearner, learner_config  # noqa: E402
from ray_xlong.rllib.results import (LearnerStepStats, learner_metrics,  # noqa: E402
                                     step_times)
from ray_xlong.trajectory import ProcessorConfig, TrajectoryProcessor, policy_loss  # noqa: E402
from ray_xlong.trajectory.loss_stats import LossStats  # noqa: E402
from ray_xlong.trajectory.model import token_logprobs  # noqa: E402
from ray_xlong.trajectory.per_run import process_run  # noqa: E402
from ray_xlong.trajectory.synthetic import SyntheticConfig, synthetic_runs  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[2]
PROC = ProcessorConfig(row_tokens=256)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(build_tiny_model_dir(tmp_path_factory.mktemp("res") / "m", seed=0))


def runs():
    cfg = SyntheticConfig(num_calls=8, vocab_size=64, context_budget=120, failed_prob=0.0)
    return synthetic_runs(7, groups=2, runs_per_group=3, config=cfg)


@pytest.mark.parametrize("grad_clip", [None, 1e-3], ids=["no_clip", "clip"])
def test_learner_reports_the_steps_loss_and_gradient_norm(model_dir, grad_clip):
    config, spec = learner_config(LearnerSettings(model_dir=model_dir, grad_clip=grad_clip),
                                  processor=PROC)
    learner = XLongLearner(config=config, module_spec=spec)
    learner.build()
    processed = [process_run(r, PROC) for r in runs()]     # as a rollout cell does
    episodes = [run_to_episode(r, processed=p) for r, p in zip(runs(), processed)]
    micro, _ = plan_step([p.digest for p in processed], processor=PROC, max_tokens=300)
    assert len(micro) > 1
    for mb in micro:
        learner.accumulate_runs(mb.run_ids, mb.advantages, 0, episodes)
    grads = learner.take_gradients()
    total = sum(mb.weight for mb in micro)
    want_norm = float(torch.sqrt(sum(((g / total).double() ** 2).sum() for g in grads.values())))
    learner.apply_step([grads], total, 1)
    stats = learner.take_step_stats(0)
    assert learner.take_step_stats(0) is None                    # taken once
    m = learner_metrics([stats])
    assert m.grad_norm == pytest.approx(want_norm, rel=1e-5) and m.grad_norm > 0

    # the whole batch at once, with the learner's starting weights
    packed = TrajectoryProcessor(PROC).process(runs()).packed
    lp = token_logprobs(load_model(model_dir).train(), packed)
    whole = float(policy_loss(lp, packed)[0].detach())
    assert m.policy_loss == pytest.approx(whole, rel=1e-4, abs=1e-6)
    assert m.num_trainable_tokens == packed.num_targets == sum(mb.targets for mb in micro)
    r = torch.exp(lp.detach().double() - packed.behaviour_logprobs.double())
    assert m.importance_ratio_max == pytest.approx(float(r.max()), rel=1e-4)
    assert m.approx_kl == pytest.approx(float(((r - 1) - torch.log(r)).mean()), rel=1e-4)
    assert m.entropy == pytest.approx(float(-lp.mean()), rel=1e-4)
    assert 0 <= m.clip_fraction <= 1 and m.tokens_per_s > 0


def test_members_merge_and_the_step_time_splits():
    a = LearnerStepStats(3, LossStats(tokens=10, loss_sum=2.0, clipped=1, ratio_sum=10.0,
                                      ratio_min=0.5, ratio_max=1.5), 1.0, 0.5, 4.0, 2.0)
    b = dataclasses.replace(a, loss=LossStats(tokens=30, loss_sum=6.0, clipped=3,
                                              ratio_sum=30.0, ratio_min=0.9, ratio_max=2.0),
                            train_s=2.0, apply_s=0.25)
    m = learner_metrics([a, b])
    # loss (2 + 6) / total 2 = 4; 4 of 40 tokens clipped; slowest member 2.25 s
    assert (m.policy_loss, m.clip_fraction, m.num_trainable_tokens) == (4.0, 0.1, 40)
    assert (m.importance_ratio_min, m.importance_ratio_max) == (0.5, 2.0)
    assert m.training_s == 2.25 and m.tokens_per_s == pytest.approx(40 / 2.25)
    t = step_times(step_s=10.0, learner=m, finish_s=1.5)
    # syncing = 1.5 - slowest apply 0.5 = 1.0; waiting = 10 - 2.25 - 1.0
    assert (t.step_training_s, t.step_syncing_s, t.step_waiting_s) == (2.25, 1.0, 6.75)


# -- the algorithm on Ray ---------------------------------------------------------------------
def readme_metric_keys() -> list[str]:
    """The keys of the metric table in docs/rllib.md (first column, in backticks)."""
    text = (ROOT / "docs" / "rllib.md").read_text()
    section = text.split("### Metric keys", 1)[1].split("\n## ", 1)[0].split("\n### ", 1)[0]
    return re.findall(r"^\| `([^`]+)` \|", section, flags=re.M)


def lookup(result: dict, key: str):
    for part in key.split("/"):
        result = result[part]
    return result


@pytest.fixture(scope="module")
def results(trained_algo):
    """The shared trained algorithm's three results (``conftest.trained_algo``: a factory task,
    evaluation at iteration 2) and the deprecation warnings logged while it ran."""
    return trained_algo.results, trained_algo.deprecations


@pytest.mark.slow
def test_rllibs_own_result_check_passes(results):
    from ray.rllib.utils.test_utils import check_train_results_new_api_stack

    for r in results[0]:
        check_train_results_new_api_stack(r)


@pytest.mark.slow
def test_every_documented_key_is_present_and_finite(results):
    keys = readme_metric_keys()
    assert len(keys) >= 40, keys
    for r in results[0]:
        for key in keys:
            value = lookup(r, key)
            assert np.isscalar(value) and math.isfinite(float(value)), (key, value)


@pytest.mark.slow
def test_lifetime_counters_add_up(results):
    rs = results[0]
    for step, r in enumerate(rs, start=1):
        assert r["num_env_steps_sampled_lifetime"] == 8 * step
        assert r["env_runners"]["num_episodes_lifetime"] == 8 * step
        assert r["learners"]["__all_modules__"]["num_env_steps_trained_lifetime"] == 8 * step
    trained = [r["learners"]["default_policy"]["num_module_steps_trained"] for r in rs]
    assert rs[-1]["learners"]["default_policy"]["num_module_steps_trained_lifetime"] \
        == sum(trained)
    assert all(r["learners"]["default_policy"]["num_learners"] >= 1 for r in rs)


@pytest.mark.slow
def test_agent_stats_describe_the_runs_trained(results):
    for r in results[0]:
        agent = r["env_runners"]["agent"]
        assert agent["runs"] == r["env_runners"]["num_episodes"] == 8
        assert sum(v for k, v in agent.items() if k.startswith("stop_")) == 8
        assert agent["model_calls_sum"] >= agent["turns_sum"] > 0
        assert agent["wall_s_p95"] >= agent["wall_s_p50"] > 0


@pytest.mark.slow
def test_no_deprecation_warning_from_rllibs_metrics_logger(results):
    assert results[1] == []


@pytest.mark.slow
def test_mismatch_metrics_are_reported(results):
    """The off-policy mismatch of every step (``trajectory/loss.py``): log-ratio mean / max,
    masked fraction and KL penalty (both 0: the default loss masks nothing and has no KL)."""
    for r in results[0]:
        lr = r["learners"]["default_policy"]
        assert abs(lr["mismatch_log_ratio_mean"]) <= lr["mismatch_log_ratio_max"]
        assert math.isfinite(lr["mismatch_log_ratio_max"])
        assert lr["masked_fraction"] == 0.0 and lr["kl_penalty"] == 0.0
