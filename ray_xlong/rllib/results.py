"""RLlib's standard result structure for :class:`XLongAlgorithm` — what one ``train()`` returns.

```
training_iteration, config (dict), num_env_steps_sampled_lifetime, num_env_steps_trained_lifetime
env_runners/   episode_return_mean, num_episodes, num_episodes_lifetime, num_env_steps_sampled,
               num_env_steps_sampled_lifetime, agent/<AGENT_KEYS>        (runs the step trained)
learners/      default_policy/<LEARNER_KEYS>, num_module_steps_trained[_lifetime]
               __all_modules__/num_env_steps_trained[_lifetime], num_module_steps_trained[_lifetime]
timers/        training_iteration, training_step (RLlib's), step_waiting_s, step_training_s,
               step_syncing_s
fault_tolerance/ num_healthy_workers, num_remote_worker_restarts, num_env_runners_dropped_lifetime
xlong/         the StepReport fields (algorithm.STEP_METRICS) and cells_<role>
```

An env step is a run (one run is one episode: ``episodes.py``); a module step is a trained token.
Learners report :class:`LearnerStepStats` for the version they trained (``XLongLearner.
take_step_stats``); :func:`learner_metrics` merges the members of a step. The step's wall time
(``StepReport.step_s``) splits into ``training`` (the slowest member's forward / backward and
optimizer step), ``syncing`` (the rest of the step's end on the driver: the gradient reduce and
the new weights pushed to the rollout cells) and ``waiting`` (the rest: runs still going, role
switches) — each ≥ 0. They sum to ``step_s`` unless training + syncing exceed it: in the
elastic and streaming modes a step's first micro-batches train while the previous ``train()``
call is still running (that time counts in ``training``, not in this call's ``step_s``), and
waiting is then 0.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

from ray.rllib.core import ALL_MODULES, DEFAULT_MODULE_ID
from ray.rllib.utils.metrics import (ENV_RUNNER_RESULTS, EPISODE_RETURN_MEAN,
                                     FAULT_TOLERANCE_STATS, LEARNER_RESULTS,
                                     NUM_ENV_STEPS_SAMPLED, NUM_ENV_STEPS_SAMPLED_LIFETIME,
                                     NUM_ENV_STEPS_TRAINED, NUM_ENV_STEPS_TRAINED_LIFETIME,
                                     NUM_EPISODES, NUM_EPISODES_LIFETIME,
                                     NUM_MODULE_STEPS_TRAINED, NUM_MODULE_STEPS_TRAINED_LIFETIME,
                                     TIMERS)

from ray_xlong.rollout.run_stats import AgentStepStats, agent_step_stats
from ray_xlong.trajectory.loss_stats import LearnerStepStats, LossStats

AGENT = "agent"
"""``env_runners/agent/...``: the agent statistics of the runs a step trained."""
LEARNER_KEYS = ("policy_loss", "clip_fraction", "approx_kl", "importance_ratio_min",
                "importance_ratio_mean", "importance_ratio_max", "entropy", "grad_norm",
                "tokens_per_s", "num_trainable_tokens", "num_learners",
                "mismatch_log_ratio_mean", "mismatch_log_ratio_max", "masked_fraction",
                "kl_penalty")
"""``learners/default_policy/<key>`` of every step (:class:`LearnerMetrics` fields)."""
TIMER_KEYS = ("step_waiting_s", "step_training_s", "step_syncing_s")
"""``timers/<key>`` of every step (:class:`StepTimes` fields)."""


@dataclasses.dataclass(frozen=True, slots=True)
class LearnerMetrics:
    """The learner metrics of one step (``learners/default_policy/<field>``)."""

    policy_loss: float
    """The step's loss (Σ micro-batch losses ÷ the step's normalizer)."""
    clip_fraction: float
    """Trained tokens whose ratio PPO clipped (TIS: whose weight was truncated)."""
    approx_kl: float
    """Mean k3 estimate of KL(behaviour ‖ current) over trained tokens."""
    importance_ratio_min: float
    """Smallest current ÷ behaviour probability ratio (1.0 when no token was trained)."""
    importance_ratio_mean: float
    """Mean ratio over trained tokens."""
    importance_ratio_max: float
    """Largest ratio (1.0 when no token was trained)."""
    entropy: float
    """Entropy estimate: mean −logprob of the trained tokens under the current policy."""
    grad_norm: float
    """Global gradient norm before clipping."""
    tokens_per_s: float
    """Trained tokens ÷ the slowest member's training seconds."""
    num_trainable_tokens: int
    """Tokens the step trained (count-once)."""
    num_learners: int
    """Learners (cells) that reported for the step."""
    training_s: float
    """The slowest member's seconds (micro-batches + optimizer step)."""
    apply_s: float
    """The slowest member's optimizer-step seconds."""
    mismatch_log_ratio_mean: float = 0.0
    """Mean ``log r = lp − lp_behaviour`` over trained tokens (rollout / learner mismatch
    plus the policy's drift since the tokens were sampled)."""
    mismatch_log_ratio_max: float = 0.0
    """Largest ``|log r|`` over trained tokens."""
    masked_fraction: float = 0.0
    """Trained tokens masked IS dropped (``LossConfig.token_mask`` / ``sequence_mask``)."""
    kl_penalty: float = 0.0
    """Mean KL penalty estimate (``LossConfig.kl_estimator``; 0 without a penalty)."""


def learner_metrics(parts: Sequence[LearnerStepStats]) -> LearnerMetrics:
    """Merge the members' reports of one step (any order)."""
    loss = LossStats()
    for p in parts:
        loss = loss.merge(p.loss)
    applied = [p for p in parts if math.isfinite(p.total)]
    total = applied[0].total if applied else 1.0
    training_s = max((p.train_s + p.apply_s for p in parts), default=0.0)
    return LearnerMetrics(
        policy_loss=loss.loss_sum / total if total > 0 else 0.0,
        clip_fraction=loss.mean("clipped"), approx_kl=loss.mean("kl_sum"),
        importance_ratio_min=loss.ratio_min if loss.tokens else 1.0,
        importance_ratio_mean=loss.mean("ratio_sum") if loss.tokens else 1.0,
        importance_ratio_max=loss.ratio_max if loss.tokens else 1.0,
        entropy=loss.mean("neg_logprob_sum"),
        grad_norm=applied[0].grad_norm if applied else 0.0,
        tokens_per_s=loss.tokens / training_s if training_s > 0 else 0.0,
        num_trainable_tokens=loss.tokens, num_learners=len(parts), training_s=training_s,
        apply_s=max((p.apply_s for p in parts), default=0.0),
        mismatch_log_ratio_mean=loss.mean("log_ratio_sum"),
        mismatch_log_ratio_max=loss.log_ratio_max, masked_fraction=loss.mean("masked"),
        kl_penalty=loss.mean("kl_penalty_sum"))


@dataclasses.dataclass(frozen=True, slots=True)
class StepTimes:
    """One step's wall seconds, split (``timers/<field>``)."""

    step_waiting_s: float
    """Waiting for runs to end, role switches, dispatch: ``step_s`` − training − syncing."""
    step_training_s: float
    """The slowest learner's seconds in the step."""
    step_syncing_s: float
    """The step's end on the driver less the optimizer step: reduce + weights to engines."""


def step_times(*, step_s: float, learner: LearnerMetrics, finish_s: float) -> StepTimes:
    """Split ``step_s`` (see the module docstring); ``finish_s``: the actuator's step end."""
    syncing = max(finish_s - learner.apply_s, 0.0)
    training = learner.training_s
    return StepTimes(step_waiting_s=max(step_s - training - syncing, 0.0),
                     step_training_s=training, step_syncing_s=syncing)


def log_step(m: Any, *, report: Any, learner: LearnerMetrics, agent: AgentStepStats | None,
             times: StepTimes) -> None:
    """Log one step into the algorithm's ``MetricsLogger`` ``m`` (window 1: the step's value;
    ``lifetime_sum`` for the lifetime counters). ``agent`` None: no run statistics (zeros)."""
    agent = agent if agent is not None else agent_step_stats([])
    env = ENV_RUNNER_RESULTS
    m.log_value((env, EPISODE_RETURN_MEAN), report.reward_mean, window=1)
    m.log_value((env, NUM_EPISODES), report.runs, reduce="sum")
    m.log_value((env, NUM_ENV_STEPS_SAMPLED), report.runs, reduce="sum")
    for key in ((env, NUM_EPISODES_LIFETIME), (env, NUM_ENV_STEPS_SAMPLED_LIFETIME),
                NUM_ENV_STEPS_SAMPLED_LIFETIME, NUM_ENV_STEPS_TRAINED_LIFETIME,
                (LEARNER_RESULTS, ALL_MODULES, NUM_ENV_STEPS_TRAINED_LIFETIME)):
        m.log_value(key, report.runs, reduce="lifetime_sum")
    m.log_value((LEARNER_RESULTS, ALL_MODULES, NUM_ENV_STEPS_TRAINED), report.runs,
                reduce="sum")
    for module in (ALL_MODULES, DEFAULT_MODULE_ID):
        m.log_value((LEARNER_RESULTS, module, NUM_MODULE_STEPS_TRAINED),
                    report.tokens_trained, reduce="sum")
        m.log_value((LEARNER_RESULTS, module, NUM_MODULE_STEPS_TRAINED_LIFETIME),
                    report.tokens_trained, reduce="lifetime_sum")
    for name in LEARNER_KEYS:
        m.log_value((LEARNER_RESULTS, DEFAULT_MODULE_ID, name), getattr(learner, name),
                    window=1)
    for name, value in agent.as_metrics().items():
        m.log_value((env, AGENT, name), value, window=1)
    for name in TIMER_KEYS:
        m.log_value((TIMERS, name), getattr(times, name), window=1)


def fault_tolerance(*, cells: int, retired: int, recoveries: int) -> dict[str, int]:
    """RLlib's ``fault_tolerance`` block with cells as the env runners: healthy cells,
    recoveries (runner / learner / node replaced) and cells retired so far."""
    return {"num_healthy_workers": cells - retired, "num_remote_worker_restarts": recoveries,
            "num_env_runners_dropped_lifetime": retired}


def complete(results: dict[str, Any], *, fault: dict[str, int]) -> dict[str, Any]:
    """``results`` with the blocks RLlib's result checks expect even before a step logged
    anything (``fault_tolerance``, ``learners`` with the default module, ``timers``,
    ``env_runners``, the lifetime counters)."""
    results[FAULT_TOLERANCE_STATS] = fault
    results.setdefault(LEARNER_RESULTS, {}).setdefault(DEFAULT_MODULE_ID, {})
    results.setdefault(TIMERS, {})
    results.setdefault(ENV_RUNNER_RESULTS, {})
    for key in (NUM_ENV_STEPS_SAMPLED_LIFETIME, NUM_ENV_STEPS_TRAINED_LIFETIME):
        results.setdefault(key, 0)
    return results


def collect_learner_stats(learners: Sequence[Any], *, version: int,
                          timeout_s: float = 60.0) -> list[LearnerStepStats]:
    """Each learner actor's :class:`LearnerStepStats` for the step that trained ``version``
    (learners that took no part, or died since, are left out: metrics never fail a step)."""
    import ray

    refs = [learner.take_step_stats.remote(version) for learner in learners]
    out = []
    for ref in refs:
        try:
            stats = ray.get(ref, timeout=timeout_s)
        except ray.exceptions.RayError:
            continue
        if stats is not None:
            out.append(stats)
    return out
