"""Evaluation rounds (``rllib/evaluation.py``), without Ray: the held-out runs are the same every
round and apart from training's seeds, pass@k is the unbiased estimator, and the metrics block
is what a hand computation gives."""

from __future__ import annotations

import math

import numpy as np
import pytest

pytest.importorskip("ray")

from ray_xlong.cells.eval_runs import EvalOutcome  # noqa: E402
from ray_xlong.cells.task_job import TaskJob  # noqa: E402
from ray_xlong.rllib.evaluation import eval_metrics, eval_specs, pass_at_k  # noqa: E402


def test_held_out_runs_are_the_same_every_round_and_not_trainings():
    a = eval_specs("lookup", instances=3, samples=2, seed=0, indexed=False, round_=0)
    b = eval_specs("lookup", instances=3, samples=2, seed=0, indexed=False, round_=5)
    assert [s.seed for s in a] == [s.seed for s in b]
    assert len({s.run_id for s in a + b}) == 12                  # run ids differ per round
    assert [s.group_id for s in a] == ["eval0-0"] * 2 + ["eval0-1"] * 2 + ["eval0-2"] * 2
    train = {TaskJob("lookup", seed=0).task_seed(g) for g in range(10_000)}
    assert not train & {s.seed for s in a}


def test_indexed_tasks_get_instances_zero_to_k():
    specs = eval_specs("qa_eval", instances=3, samples=1, seed=9, indexed=True, round_=1)
    assert [s.seed for s in specs] == [0, 1, 2]


@pytest.mark.parametrize("n,c,k", [(4, 0, 1), (4, 1, 1), (4, 1, 4), (5, 2, 3), (8, 3, 2)])
def test_pass_at_k_is_the_unbiased_estimator(n, c, k):
    # P(at least one pass among k drawn without replacement), by enumeration
    from itertools import combinations

    draws = list(combinations([1] * c + [0] * (n - c), k))
    assert pass_at_k(n, c, k) == pytest.approx(sum(any(d) for d in draws) / len(draws))


def test_pass_at_k_refuses_impossible_counts():
    with pytest.raises(ValueError, match="pass_at_k"):
        pass_at_k(2, 3, 1)


def test_metrics_block():
    rewards = {"eval0-0": [1.0, 0.0, 0.2], "eval0-1": [0.0, 0.0, 0.0]}
    outcomes = [EvalOutcome(f"e0-{g}-{i}", g, r, cell=i % 2, version=4 + (r > 0.5))
                for g, rs in rewards.items() for i, r in enumerate(rs)]
    m = eval_metrics(outcomes, threshold=1.0, seconds=2.5, wait_s=0.5, preempted=1)
    assert m["episode_return_mean"] == pytest.approx(1.2 / 6)
    assert (m["num_episodes"], m["num_instances"], m["policy_version"]) == (6, 2, 4)
    assert (m["policy_version_max"], m["num_preempted"], m["eval_wait_s"]) == (5, 1, 0.5)
    assert m["pass_at_1"] == pytest.approx((1 / 3 + 0) / 2)
    assert m["pass_at_3"] == pytest.approx(0.5)
    assert all(np.isscalar(v) and math.isfinite(v) for v in m.values())


def test_a_round_with_no_run_ended_is_a_block_of_nans_not_an_error():
    m = eval_metrics([], threshold=1.0, seconds=1.0)
    assert (m["num_episodes"], m["num_instances"]) == (0, 0)
    assert math.isnan(m["episode_return_mean"]) and "pass_at_1" not in m
