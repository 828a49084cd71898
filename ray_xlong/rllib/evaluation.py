"""Evaluation during training through RLlib's own ``.evaluation(...)`` config.

``config.evaluation(evaluation_interval=N, evaluation_duration=K,
evaluation_num_env_runners=E)`` makes ``XLongAlgorithm.train()`` evaluate every N-th iteration
(RLlib's ``Algorithm.step`` decides when; ``evaluation_parallel_to_training=True`` runs it
beside the step, RLlib's thread)::

    K held-out instances × k samples (k = xlong(eval_samples), default runs_per_group)
      ─► evaluation runners (E = 0: one AgentEnvRunner in the driver process; E >= 1: E
         runner actors with the evaluation config's CPUs / GPUs), engine on the weights of the
         latest policy version
      ─► result["evaluation"]["env_runners"]: episode_return_mean, episode_return_min / _max,
         num_episodes, num_instances, pass_at_1, pass_at_<k>, policy_version, eval_s

The held-out set is the same at every evaluation, so rounds compare: instances ``0..K-1`` of
``xlong(eval_task)`` (a ``DatasetTask`` split: its rows; a seeded task: seeds drawn from the job
seed on a stream training never draws). Evaluation runs are not trained on: they never reach
the cells' runners, whose ended runs are the only ones the scheduler trains. A run passes when
its reward ``>= xlong(eval_pass_threshold)``; pass@k is the unbiased estimator
``1 − C(n−c, k) / C(n, k)`` over an instance's ``n`` samples with ``c`` passes, averaged over
instances.
"""

from __future__ import annotations

import math
import time
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from ray_xlong.cells.runs import RunSpec

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


def eval_metrics(rewards: Mapping[str, Sequence[float]], *, threshold: float,
                 version: int, seconds: float) -> dict[str, float]:
    """The ``evaluation/env_runners`` block from each instance's rewards (by group id)."""
    flat = [r for rs in rewards.values() for r in rs]
    k = min(len(rs) for rs in rewards.values())
    out = {"episode_return_mean": float(np.mean(flat)), "episode_return_min": float(min(flat)),
           "episode_return_max": float(max(flat)), "num_episodes": len(flat),
           "num_instances": len(rewards), "policy_version": version, "eval_s": seconds}
    for kk in sorted({1, k}):
        out[f"pass_at_{kk}"] = float(np.mean([
            pass_at_k(len(rs), sum(r >= threshold for r in rs), kk) for rs in rewards.values()]))
    return out


class EvaluationRunners:
    """The runners evaluation rounds run on (module docstring), built on first use."""

    def __init__(self, make_local: Callable[[], Any], make_remote: Callable[[], Any],
                 count: int) -> None:
        self._make_local, self._make_remote, self.count = make_local, make_remote, count
        self.runners: list[Any] | None = None
        self.version: int | None = None

    def _call(self, runner: Any, method: str, *args: Any) -> Any:
        import ray

        fn = getattr(runner, method)
        return ray.get(fn.remote(*args)) if hasattr(fn, "remote") else fn(*args)

    def run(self, specs: Sequence[RunSpec], *, weights: Callable[[], Any], version: int,
            timeout_s: float) -> list[Any]:
        """Run ``specs`` on the policy of ``version`` and return the ``RunResult`` of every
        run. ``weights()`` gives an object ref of that version's weights, taken only when the
        runners hold another version: runner actors resolve it themselves (the weights do
        not pass through the driver unless the runner is local)."""
        import ray

        if self.runners is None:
            self.runners = ([self._make_local()] if self.count == 0
                            else [self._make_remote() for _ in range(self.count)])
        if self.version != version:
            ref = weights()
            for r in self.runners:
                if hasattr(r.set_weights, "remote"):
                    ray.get(r.set_weights.remote(ref, version))
                else:
                    r.set_weights(ray.get(ref), version)
            self.version = version
        for i, r in enumerate(self.runners):
            self._call(r, "start_runs", list(specs[i::len(self.runners)]))
        results, deadline = [], time.monotonic() + timeout_s
        while len(results) < len(specs):
            if time.monotonic() > deadline:
                raise TimeoutError(f"evaluation: {len(results)} of {len(specs)} runs ended "
                                   f"within evaluation_sample_timeout_s={timeout_s}")
            for r in self.runners:
                results.extend(self._call(r, "sample_results"))
            time.sleep(0.05)
        return results

    def stop(self) -> None:
        """Stop the runners (actors are killed)."""
        import ray

        for r in self.runners or []:
            if hasattr(r, "stop") and hasattr(r.stop, "remote"):
                ray.kill(r)
            else:
                r.stop()
        self.runners = None


def _eval_runner_class():
    from ray_xlong.rllib.env_runner import AgentEnvRunner
    from ray_xlong.rollout.tasks import TASKS

    class EvalRunner(AgentEnvRunner):
        """An :class:`AgentEnvRunner` that first registers the job's own tasks (by name)."""

        def __init__(self, *, config: Any, rollout_config: Any,
                     tasks: Mapping[str, Any]) -> None:
            for name, factory in tasks.items():
                TASKS.setdefault(name, factory)
            super().__init__(config=config, rollout_config=rollout_config)

    return EvalRunner


def evaluation_runners(*, rollout: Any, tasks: Mapping[str, Any], count: int,
                       cpus: float, gpus: float) -> EvaluationRunners:
    """Runners for ``rollout`` (``RolloutConfig``) knowing ``tasks``: ``count == 0`` one in
    this process, else ``count`` Ray actors of ``cpus`` / ``gpus`` each."""
    from ray.rllib.algorithms.algorithm_config import AlgorithmConfig

    cls = _eval_runner_class()
    kwargs = {"config": AlgorithmConfig(), "rollout_config": rollout, "tasks": dict(tasks)}

    def remote() -> Any:
        import ray

        return ray.remote(num_cpus=cpus, num_gpus=gpus)(cls).remote(**kwargs)

    return EvaluationRunners(lambda: cls(**kwargs), remote, count)
