"""RLlib's ``.evaluation(...)`` on the rollout cells (``rllib/evaluation.py``), read from the
shared trained algorithm (``conftest.trained_algo``: evaluation_interval=2,
evaluation_duration=2, eval_samples=2, 3 iterations): the round's runs were placed on cells in
rollout and ended there, no step trained them, the spool never held them, and the keys come at
the interval only. Colocated cells with evaluation every iteration (every round complete, every
step reported at once): ``test_algorithm.py``'s user connector piece job."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.ray
pytest.importorskip("ray")

ROUND = {f"e0-{j}-{s}" for j in range(2) for s in range(2)}
"""Run ids of the one round (iteration 2): 2 instances × 2 samples."""


@pytest.mark.slow
def test_evaluation_runs_ran_on_rollout_cells(trained_algo):
    ev = trained_algo.eval_runs
    assert {p.run_id for p in ev.placements} == ROUND
    assert all(p.role == "rollout" and p.cell in (0, 1) for p in ev.placements)
    last_cell = {p.run_id: p.cell for p in ev.placements}   # a preempted run starts again
    ended = {o.run_id: o for o in ev.ended}
    assert set(ended) == ROUND and len(ev.ended) == len(ROUND)
    assert all(ended[r].cell == last_cell[r] for r in ROUND)  # the cell it was placed on ran it
    assert all(o.group_id in ("eval0-0", "eval0-1") and not o.failed for o in ev.ended)
    block = trained_algo.results[1]["evaluation"]["env_runners"]
    assert block["num_preempted"] == len(ev.placements) - len(ROUND)


@pytest.mark.slow
def test_evaluation_runs_are_in_no_training_batch(trained_algo):
    trained = [r for runs in trained_algo.trained_runs.values() for r in runs]
    assert len(trained) == len(set(trained)) >= 3 * 8   # 3 steps × 8 runs (+ the next one's)
    assert all(r.startswith("r") for r in trained) and not set(trained) & ROUND
    assert not set(trained_algo.spooled) & ROUND
    assert [r["xlong"]["runs"] for r in trained_algo.results] == [8, 8, 8]


@pytest.mark.slow
def test_evaluation_keys_come_at_the_interval(trained_algo):
    has = ["evaluation" in r for r in trained_algo.results]
    assert has == [False, True, False]
    block = trained_algo.results[1]["evaluation"]["env_runners"]
    for key in ("episode_return_mean", "pass_at_1", "pass_at_2", "num_episodes",
                "policy_version", "policy_version_max", "eval_s", "eval_wait_s"):
        assert key in block, key
    assert block["policy_version"] == block["policy_version_max"] == 2   # the step just made
    assert block["eval_wait_s"] >= 0.0
