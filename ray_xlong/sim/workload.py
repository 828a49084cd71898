"""Workload model: how long each agent run takes and how many tokens it trains.

A run's duration is lognormal with a heavy right tail, correlated within a group (runs of one
task are alike), capped at a timeout (a timed-out run ends at the cap and is still trained, as
in docs/design.md). A small fraction fails early. Trained tokens grow linearly with duration (the
agent generates at a steady pace) times the unique-token fraction of the run's prefix tree
(count-once training only pays for unique tree tokens).

```
log d = log median + sigma * (rho * z_task + sqrt(1 - rho^2) * z_run),   d = min(d, timeout)
tokens = tokens_per_hour * d * unique_token_frac
```

Drift (issue 15), both off by default: ``median_growth`` scales the median *and* the timeout of
group k by ``median_growth ** (k / (groups - 1))`` (horizons grow as the policy learns: the last
group's median is ``median_growth`` × the first's) and its tokens per hour by
``token_rate_growth ** (k / (groups - 1))``; ``then`` replaces the whole distribution from
group ``ceil(then_from × groups)`` on (an abrupt change of the task mix). Groups are admitted in
index order, so a group's index is its place in training.

Invariants: 0 < duration <= the group's timeout; sampling is a pure function of
(config, runs, seed).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True)
class WorkloadConfig:
    """Distribution of run durations and tokens."""

    median_run_h: float
    """Median run duration before the timeout cap, hours."""
    sigma: float
    """Lognormal shape: tail heaviness (0 = every run takes the median)."""
    timeout_h: float
    """Runs longer than this end as ``timeout`` at exactly this duration."""
    tokens_per_run_h: float
    """Tokens a run produces per hour of its duration."""
    unique_token_frac: float = 1.0
    """Unique prefix-tree tokens / all trajectory tokens (branching; 1 = no sharing)."""
    task_corr: float = 0.0
    """Correlation of log-durations within a group (task difficulty), in [0, 1]."""
    failure_rate: float = 0.0
    """Fraction of runs that fail early (environment error) at a uniform point of their run."""
    median_growth: float = 1.0
    """Median and timeout of the job's last group ÷ its first's, geometric in the group index."""
    token_rate_growth: float = 1.0
    """``tokens_per_run_h`` of the last group ÷ the first's, geometric like ``median_growth``
    (``1 / median_growth`` keeps tokens per run flat: the longer horizon is tool time)."""
    then: WorkloadConfig | None = None
    """The distribution from ``then_from`` of the job on (an abrupt task-mix change), or None."""
    then_from: float = 0.5
    """Fraction of the job's groups after which ``then`` applies, in (0, 1)."""

    def __post_init__(self) -> None:
        for name in ("median_run_h", "timeout_h", "tokens_per_run_h", "median_growth",
                     "token_rate_growth"):
            if not getattr(self, name) > 0:
                raise ValueError(f"WorkloadConfig.{name}: must be > 0, got {getattr(self, name)}")
        if self.sigma < 0:
            raise ValueError(f"WorkloadConfig.sigma: must be >= 0, got {self.sigma}")
        for name in ("unique_token_frac", "task_corr", "failure_rate"):
            v = getattr(self, name)
            if not 0 <= v <= 1 or (name == "unique_token_frac" and v == 0):
                raise ValueError(f"WorkloadConfig.{name}: must be in (0, 1] / [0, 1], got {v}")
        if not 0 < self.then_from < 1:
            raise ValueError(f"WorkloadConfig.then_from: must be in (0, 1), got {self.then_from}")

    @property
    def stationary(self) -> bool:
        """No drift and no shift: every group follows the same distribution."""
        return self.median_growth == self.token_rate_growth == 1.0 and self.then is None

    @property
    def max_timeout_h(self) -> float:
        """The longest any run of the job may take (the last group's timeout, or ``then``'s)."""
        own = self.timeout_h * self.median_growth
        return max(own, self.then.max_timeout_h) if self.then is not None else own

    def mean_duration_h(self) -> float:
        """E[run duration] after the timeout cap and early failures (capped-lognormal formula)."""
        t, m, s = self.timeout_h, self.median_run_h, self.sigma
        if s == 0:
            capped = min(m, t)
        else:
            phi = lambda x: 0.5 * math.erfc(-x / math.sqrt(2))  # noqa: E731 (standard normal CDF)
            z = (math.log(t) - math.log(m)) / s
            capped = m * math.exp(s * s / 2) * phi(z - s) + t * (1 - phi(z))
        return capped * (1 - self.failure_rate * (1 - 0.525))  # a failure stops at U(0.05, 1)

    def frac_at_least(self, hours: float) -> float:
        """P(duration >= hours) before failures (used to calibrate against "61% >= 4 h")."""
        if hours > self.timeout_h:
            return 0.0
        if self.sigma == 0:
            return 1.0 if self.median_run_h >= hours else 0.0
        z = (math.log(hours) - math.log(self.median_run_h)) / self.sigma
        return 0.5 * math.erfc(z / math.sqrt(2))


@dataclass(frozen=True, slots=True)
class Workload:
    """Sampled durations and trained tokens, indexed by run id (group = run // group_size)."""

    durations_h: tuple[float, ...]
    """Duration of each run, hours."""
    tokens: tuple[float, ...]
    """Trained (unique) tokens of each run."""
    group_size: int
    """Runs per group."""

    def __post_init__(self) -> None:
        if len(self.durations_h) != len(self.tokens) or len(self.tokens) % self.group_size:
            raise ValueError(
                f"Workload.tokens: {len(self.tokens)} runs vs {len(self.durations_h)} durations, "
                f"group_size {self.group_size}"
            )

    def group_tokens(self, group: int) -> float:
        """Trained tokens of one group."""
        g = self.group_size
        return sum(self.tokens[group * g:(group + 1) * g])


def sample_workload(config: WorkloadConfig, *, runs: int, group_size: int, seed: int) -> Workload:
    """Draw ``runs`` runs (a multiple of ``group_size``) deterministically from ``seed``.

    Returns:
        Workload with ``runs`` durations and token counts.
    """
    if runs < 1 or runs % group_size:
        raise ValueError(f"sample_workload.runs: {runs} is not a positive multiple of {group_size}")
    d, tokens = _sample(config, runs=runs, group_size=group_size, seed=seed)
    if config.then is not None:
        cut = math.ceil(config.then_from * runs / group_size) * group_size
        d2, t2 = _sample(config.then, runs=runs, group_size=group_size, seed=seed + 1)
        d, tokens = np.concatenate([d[:cut], d2[cut:]]), np.concatenate([tokens[:cut], t2[cut:]])
    return Workload(tuple(d.tolist()), tuple(tokens.tolist()), group_size)


def _sample(config: WorkloadConfig, *, runs: int, group_size: int,
            seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Durations and tokens of every run under ``config`` alone (its ``then`` ignored)."""
    rng = np.random.default_rng(seed)
    rho, groups = config.task_corr, runs // group_size
    z_task = np.repeat(rng.standard_normal(groups), group_size)
    z = rho * z_task + math.sqrt(1 - rho * rho) * rng.standard_normal(runs)
    where = np.repeat(np.arange(groups) / max(1, groups - 1), group_size)
    scale = config.median_growth ** where  # 1 at the first group, median_growth at the last
    d = np.minimum(config.median_run_h * scale * np.exp(config.sigma * z), config.timeout_h * scale)
    failed = rng.random(runs) < config.failure_rate
    d = np.where(failed, d * rng.uniform(0.05, 1.0, runs), d)
    rate = config.tokens_per_run_h * config.token_rate_growth ** where
    return d, d * rate * config.unique_token_frac
