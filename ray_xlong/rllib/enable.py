"""``enable(config, **xlong_options)``: turn a user's existing RLlib ``AlgorithmConfig`` into an
:class:`~ray_xlong.rllib.algorithm_config.XLongConfig`, keeping what they set.

Rule: every setting the user *changed* from their config class's default either carries over
(table below), is bookkeeping that means the same thing here (logging, seeds, timing), or is
named in an :class:`EnableError` with the reason — nothing is dropped silently. Settings left at
their class default (e.g. PPO's value-function and KL terms) are the algorithm's own loss, which
the xlong token loss (PPO clip on model tokens, GRPO group baselines, no critic) replaces.

    user setting                              xlong meaning
    lr, grad_clip, grad_clip_by               the cells' Learner optimizer (global-norm clip)
    train_batch_size(_per_learner)            runs per step (groups × runs_per_group)
    callbacks (class and on_* callables)      the same RLlib callbacks on XLongAlgorithm
    learner_connector                         run in every cell Learner's connector pipeline,
                                              before PrefixTreeConnector (RLlib's order)
    add_default_…                             kept (RLlib's default pieces are not added: the
                                              module batch is PrefixTreeConnector's)
    num_env_runners / num_learners            cells (a cell hosts one runner and one Learner)
    num_cpus_per_env_runner                   CPUs of a cell's bundle
    num_gpus_per_env_runner                   GPUs of a cell's bundle
    clip_param (PPO)                          PPO clip ε (low = high)
    kl_coeff, use_kl_loss=False (PPO)         LossConfig.kl_coef (k3 towards the behaviour
                                              logprobs; 0 when the KL loss is turned off)
    evaluation_interval, _duration, _unit,    RLlib's evaluation rounds on held-out instances,
    _parallel_to_training, _sample_timeout_s  on the rollout cells (rllib/evaluation.py)
    evaluation_num_env_runners                kept, logged as not used (the cells evaluate)
    model_config["model_dir" | "dtype"]       the HF causal LM the RLModule wraps
    seed                                      seed (model, tasks, engines)

``ignore=("name", ...)`` accepts dropping named settings explicitly.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterable

from ray.rllib.algorithms.algorithm_config import AlgorithmConfig

from ray_xlong.rllib.algorithm_config import XLongConfig, XLongOptions

BOOKKEEPING = frozenset({
    "log_level", "log_sys_usage", "logger_config", "min_time_s_per_iteration",
    "min_sample_timesteps_per_iteration", "min_train_timesteps_per_iteration",
    "metrics_num_episodes_for_smoothing", "extra_python_environs_for_driver",
    "extra_python_environs_for_worker", "num_cpus_for_main_process", "placement_strategy",
    "checkpoint_trainable_policies_only", "restart_failed_env_runners",
    "max_num_env_runner_restarts", "ignore_env_runner_failures",
})
"""Settings copied as they are (they mean the same thing for an XLongAlgorithm)."""

REASONS = {
    "env": "xlong runs agent tasks, not RLlib envs (use xlong(task=...))",
    "env_config": "xlong runs agent tasks, not RLlib envs",
    "gamma": "a run has one reward at its end (no discounting over tokens)",
    "lambda_": "no critic: advantages are GRPO group baselines",
    "use_gae": "no critic: advantages are GRPO group baselines",
    "use_critic": "no critic: advantages are GRPO group baselines",
    "vf_loss_coeff": "no value function",
    "vf_clip_param": "no value function",
    "kl_target": "the xlong KL penalty has a fixed coefficient (LossConfig.kl_coef)",
    "entropy_coeff": "the xlong token loss has no entropy term",
    "num_epochs": "one optimizer step per batch of groups",
    "minibatch_size": "micro-batches are token budgets (xlong(micro_batch_tokens=...))",
    "framework": "the Learners are torch",
    "policies": "one policy (the LM) per job",
    "num_gpus_per_learner": "Learners take their cell's share (gpus_per_node)",
}
"""Why a changed setting cannot carry over (others: no xlong counterpart)."""


class EnableError(ValueError):
    """Settings of the given config that cannot carry over (each named, with the reason)."""


def _carry_batch(out: XLongConfig, value: Any) -> None:
    out.training(train_batch_size_per_learner=int(value))


def _carry_model_config(out: XLongConfig, value: Any) -> None:
    value = dict(value or {})
    unknown = sorted(set(value) - {"model_dir", "dtype"})
    if unknown:
        raise EnableError(f"model_config keys {unknown}: the xlong RLModule takes only "
                          f"'model_dir' and 'dtype'")
    out.rl_module(model_config=value)


def _carry_loss(out: XLongConfig, **fields: Any) -> None:
    out.xlong(loss=dataclasses.replace(out.xlong_options.loss, **fields))


EVALUATION = ("evaluation_interval", "evaluation_duration", "evaluation_duration_unit",
              "evaluation_num_env_runners", "evaluation_parallel_to_training",
              "evaluation_sample_timeout_s")
"""RLlib evaluation settings that carry over as they are (``rllib/evaluation.py``)."""


def _carry_cells(out: XLongConfig, value: Any) -> None:
    if value:
        out.env_runners(num_env_runners=int(value))


CARRY: dict[str, Callable[[XLongConfig, Any], None]] = {
    "lr": lambda out, v: out.training(lr=float(v)),
    "grad_clip": lambda out, v: out.training(grad_clip=v),
    "grad_clip_by": lambda out, v: out.training(grad_clip_by=v),
    "train_batch_size": _carry_batch,
    "_train_batch_size_per_learner": _carry_batch,
    "callbacks": lambda out, v: out.callbacks(callbacks_class=v),
    "_learner_connector": lambda out, v: out.training(learner_connector=v),
    "add_default_connectors_to_learner_pipeline":
        lambda out, v: out.training(add_default_connectors_to_learner_pipeline=v),
    "num_env_runners": _carry_cells,
    "num_learners": _carry_cells,
    "num_cpus_per_env_runner": lambda out, v: out.env_runners(num_cpus_per_env_runner=v),
    "num_gpus_per_env_runner": lambda out, v: out.env_runners(num_gpus_per_env_runner=v),
    "clip_param": lambda out, v: _carry_loss(out, clip_low=v, clip_high=v),
    "kl_coeff": lambda out, v: _carry_loss(out, kl_coef=float(v)),
    "use_kl_loss": lambda out, v: None if v else _carry_loss(out, kl_coef=0.0),
    "_model_config": _carry_model_config,
    "model_config": _carry_model_config,
    "seed": lambda out, v: out.debugging(seed=v),
    **{key: (lambda out, v, key=key: setattr(out, key, v)) for key in EVALUATION},
}
"""How each carried setting lands on the XLongConfig."""


def changed_settings(config: AlgorithmConfig) -> dict[str, Any]:
    """``{to_dict key: value}`` of the settings that differ from ``type(config)()``'s."""
    now, default = config.to_dict(), type(config)().to_dict()
    return {k: v for k, v in now.items() if not _same(v, default.get(k))}


def _same(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - arrays, objects without a bool ==
        return a is b


def enable(config: AlgorithmConfig, *, ignore: Iterable[str] = (),
           **xlong_options: Any) -> XLongConfig:
    """An :class:`XLongConfig` with ``config``'s settings and ``.xlong(**xlong_options)``.

    Args:
        config: the user's config (any ``AlgorithmConfig``: PPOConfig, APPOConfig, …; an
            XLongConfig is copied).
        ignore: names (``to_dict`` keys) of changed settings the caller accepts to drop.
        **xlong_options: fields of :class:`XLongOptions` (mode, cells, engine, task, …).

    Returns:
        A new, unfrozen XLongConfig (``config`` is not modified).

    Raises:
        EnableError: changed settings with no xlong meaning (all named at once), or an
            unknown xlong option.
    """
    unknown = sorted(set(xlong_options) - set(XLongOptions.__dataclass_fields__))
    if unknown:
        raise EnableError(f"enable: unknown xlong options {unknown}; known: "
                          f"{sorted(XLongOptions.__dataclass_fields__)}")
    if isinstance(config, XLongConfig):
        return config.copy(copy_frozen=False).xlong(**xlong_options)
    out, problems, skip = XLongConfig(), [], set(ignore)
    for key, value in sorted(changed_settings(config).items()):
        if key in skip:
            continue
        if key.startswith("callbacks_on_"):
            setattr(out, key, value)
        elif key in BOOKKEEPING:
            setattr(out, key, value)
        elif key in CARRY:
            CARRY[key](out, value)
        else:
            problems.append(f"{key}={value!r}: {REASONS.get(key, 'no xlong counterpart')}")
    if problems:
        raise EnableError(f"enable: {len(problems)} setting(s) of the given "
                          f"{type(config).__name__} cannot carry over to xlong (pass "
                          f"ignore=(...) to drop them): " + "; ".join(problems))
    return out.xlong(**xlong_options)
