"""Evaluation during training through RLlib's own ``.evaluation(...)`` config, on the rollout
cells.

``config.evaluation(evaluation_interval=N, evaluation_duration=K)`` makes
``XLongAlgorithm.train()`` evaluate every N-th iteration (RLlib's ``Algorithm.step`` decides when
and calls :func:`evaluate`; ``evaluation_parallel_to_training=True`` calls it beside the step,
RLlib's thread)::

    K held-out instances × k samples (k = xlong(eval_samples), default runs_per_group)
      ─► EvalRuns (cells/eval_runs.py) ─► the actuator places them on cells in rollout, beside
         the training runs, on the weights those cells serve (sequential: the version the step
         just made; parallel: the version the iteration started from)
      ─► result["evaluation"]["env_runners"]: episode_return_mean, episode_return_min / _max,
         num_episodes, num_instances, pass_at_1, pass_at_<k>, policy_version (oldest version
         the runs used), policy_version_max, num_preempted, eval_s, eval_wait_s

How long training waits: the round runs while the cells go on. Sequentially, :func:`evaluate`
ticks the cell loop itself until the round ended: runs start and end, micro-batches of the next
step train, only the *application* of a complete next step waits for the round's last runs
(``RayActuator.hold_step_finish``; ``eval_wait_s`` is that wall time) — unless every cell is
training (colocated), when the step is applied so the cells come back to rollout (the next
``train()`` then reports it at once: ``SteppingActuator.next_step``). In parallel the training
thread ticks; once its step is done :func:`evaluate` ticks the same way. A cell that leaves
rollout cancels its evaluation runs (they start again on another rollout cell): evaluation never
delays a role switch. ``evaluation_sample_timeout_s`` bounds a round: past it the round reports
the runs that ended (a warning names the setting), as RLlib does.

The held-out set is the same at every evaluation, so rounds compare: instances ``0..K-1`` of
``xlong(eval_task)`` (a ``DatasetTask`` split: its rows; a seeded task: seeds drawn from the job
seed on a stream training never draws). Evaluation runs are not trained on: a runner reports
them apart from the runs it hands to the scheduler (never spooled, never in ``wait_ended``), so
no step, group or run count sees them. A run passes when its reward
``>= xlong(eval_pass_threshold)``; pass@k is the unbiased estimator ``1 − C(n−c, k) / C(n, k)``
over an instance's ``n`` samples with ``c`` passes, averaged over instances.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from typing import Any, Sequence

import numpy as np

from ray_xlong.cells.eval_runs import EvalOutcome, EvalRuns
from ray_xlong.cells.runs import RunSpec

log = logging.getLogger(__name__)

EVAL_SEED_STREAM = 7_000_003
"""Seed-sequence word of held-out task seeds (training draws ``[seed, group]``, two words)."""


def eval_specs(task: str, *, instances: int, samples: int, seed: int, indexed: bool,
               round_: int) -> list[RunSpec]:
    """The runs of one evaluation round: ``samples`` runs of each of ``instances`` instances.

    Args:
        task: the evaluation task's name.
        instances: K held-out instances (the same ones every round).
        samples: k runs per instance.
        seed: the job seed.
        indexed: the task takes instance indices (``DatasetTask``) rather than seeds.
        round_: the evaluation round (only in run ids).
    """
    specs = []
    for j in range(instances):
        task_seed = j if indexed else int(np.random.default_rng(
            [seed, EVAL_SEED_STREAM, j]).integers(0, 2**31))
        for s in range(samples):
            specs.append(RunSpec(task, task_seed, f"e{round_}-{j}-{s}", f"eval{round_}-{j}"))
    return specs


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of ``n`` samples with ``c`` passes (Chen et al. 2021)."""
    if not 1 <= k <= n or not 0 <= c <= n:
        raise ValueError(f"pass_at_k: need 1 <= k <= n and 0 <= c <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def eval_metrics(outcomes: Sequence[EvalOutcome], *, threshold: float, seconds: float,
                 wait_s: float = 0.0, preempted: int = 0) -> dict[str, float]:
    """The ``evaluation/env_runners`` block of a round's outcomes (pass@k by instance)."""
    rewards: dict[str, list[float]] = {}
    for o in outcomes:
        rewards.setdefault(o.group_id, []).append(float(o.reward))
    flat = [r for rs in rewards.values() for r in rs]
    versions = [o.version for o in outcomes]
    nan = float("nan")
    out = {"episode_return_mean": float(np.mean(flat)) if flat else nan,
           "episode_return_min": float(min(flat, default=nan)),
           "episode_return_max": float(max(flat, default=nan)),
           "num_episodes": len(flat), "num_instances": len(rewards),
           "policy_version": min(versions, default=-1),
           "policy_version_max": max(versions, default=-1), "num_preempted": preempted,
           "eval_s": seconds, "eval_wait_s": wait_s}
    if rewards:
        k = min(len(rs) for rs in rewards.values())
        for kk in sorted({1, k}):
            out[f"pass_at_{kk}"] = float(np.mean([
                pass_at_k(len(rs), sum(r >= threshold for r in rs), kk)
                for rs in rewards.values()]))
    return out


class CellEvaluation:
    """The evaluation rounds of one algorithm: what to run, and the mailbox (``runs``) the
    actuator places from. Rounds are numbered in order; one per evaluating iteration."""

    def __init__(self, *, task: str, instances: int, samples: int, seed: int, indexed: bool,
                 threshold: float, timeout_s: float) -> None:
        self.task, self.instances, self.samples = task, instances, samples
        self.seed, self.indexed, self.threshold = seed, indexed, threshold
        self.timeout_s = timeout_s
        self.runs = EvalRuns()
        self._lock = threading.Lock()
        self._next = 0

    def submit(self) -> int:
        """Queue the next round's runs; returns its number."""
        with self._lock:
            round_, self._next = self._next, self._next + 1
        self.runs.submit(round_, eval_specs(self.task, instances=self.instances,
                                            samples=self.samples, seed=self.seed,
                                            indexed=self.indexed, round_=round_))
        return round_


_BUILD = threading.Lock()
"""One :class:`CellEvaluation` per algorithm, even when RLlib's evaluation thread and the
training thread ask for it at once."""


def cell_evaluation(algo: Any) -> CellEvaluation:
    """``algo``'s :class:`CellEvaluation`, built on first use from its config."""
    with _BUILD:
        return _cell_evaluation(algo)


def _cell_evaluation(algo: Any) -> CellEvaluation:
    if algo._evaluation is None:
        opt, cfg = algo.config.xlong_options, algo.evaluation_config
        duration = cfg.evaluation_duration
        algo._evaluation = CellEvaluation(
            task=opt.eval_task_name, instances=int(duration) if duration != "auto" else 1,
            samples=opt.eval_samples or opt.runs_per_group, seed=int(algo.config.seed or 0),
            indexed=bool(getattr(eval_factory(opt), "indexed_instances", False)),
            threshold=opt.eval_pass_threshold,
            timeout_s=float(cfg.evaluation_sample_timeout_s))
    return algo._evaluation


def eval_factory(opt: Any) -> Any:
    """The evaluation task's factory (``XLongOptions``: ``eval_task``, else ``task``)."""
    from ray_xlong.rollout.tasks import TASKS

    return opt.eval_task_factory or opt.task_factory or TASKS.get(opt.eval_task_name)


def eval_tasks(opt: Any) -> dict[str, Any]:
    """``{name: factory}`` of an evaluation task that is not built in (the cells register
    it beside the training task)."""
    return {opt.eval_task_name: opt.eval_task_factory} if opt.eval_task_factory else {}


def attach(algo: Any) -> None:
    """Hand ``algo``'s evaluation mailbox to its actuator (places runs on its ticks)."""
    algo.actuator.actuator.evals = cell_evaluation(algo).runs


def can_host(act: Any) -> bool:
    """Whether a cell not retired is out of training (in rollout, or on its way back there):
    only then is holding a complete step worth it. When every cell trains (colocated), the
    step is applied so that cells return to rollout and the round can go on."""
    from ray_xlong.scheduling import Role

    return any(role is not Role.TRAINING and c not in act.retired
               for c, role in enumerate(act.m.role))


def evaluate(algo: Any, parallel_train_future: Any = None) -> dict[str, Any]:
    """One round (module docstring) on ``algo``'s rollout cells. Returns RLlib's
    ``evaluation`` block (``{"env_runners": {...}}``)."""
    from ray.rllib.utils.metrics import ENV_RUNNER_RESULTS

    ev = cell_evaluation(algo)
    start = time.perf_counter()
    round_ = ev.submit()
    deadline, wait_s = time.monotonic() + ev.timeout_s, 0.0
    while not ev.runs.done(round_) and time.monotonic() < deadline:
        if parallel_train_future is not None and not parallel_train_future.done():
            ev.runs.wait(0.05)                  # the training thread ticks the cells
            continue
        if algo.actuator is None:
            algo.actuator = algo._start_actuator()
            attach(algo)
        act = algo.actuator.actuator
        t = time.perf_counter()
        act.hold_step_finish = can_host(act)
        try:
            act.tick()
        finally:
            act.hold_step_finish = False
            wait_s += time.perf_counter() - t
    complete = ev.runs.done(round_)
    outcomes = ev.runs.close(round_)
    if not complete:
        log.warning("evaluation round %d: %d of %d runs ended within "
                    "evaluation_sample_timeout_s=%g; reporting those", round_, len(outcomes),
                    ev.instances * ev.samples, ev.timeout_s)
    preempted = ev.runs.preempted
    ev.runs.preempted = 0
    return {ENV_RUNNER_RESULTS: eval_metrics(outcomes, threshold=ev.threshold,
                                             seconds=time.perf_counter() - start,
                                             wait_s=wait_s, preempted=preempted)}
