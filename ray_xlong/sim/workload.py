"""Workload model: how long each agent run takes and how many tokens it trains.

A run's duration is lognormal with a heavy right tail, correlated within a group (runs of one
task are alike), capped at a timeout (a timed-out run ends at the cap and is still trained, as
in DESIGN.md). A small fraction fails early. Trained tokens grow linearly with duration (the
agent generates at a steady pace) times the unique-token fraction of the run's prefix tree
(count-once training only pays for unique tree tokens).

```
log d = log median + sigma * (rho * z_task + sqrt(1 - rho^2) * z_run),   d = min(d, timeout)
tokens = tokens_per_hour * d * unique_token_frac
```

Invariants: 0 < duration <= timeout_h; sampling is a pure function of (config, runs, seed).
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

    def __post_init__(self) -> None:
        for name in ("median_run_h", "timeout_h", "tokens_per_run_h"):
            if not getattr(self, name) > 0:
                raise ValueError(f"WorkloadConfig.{name}: must be > 0, got {getattr(self, name)}")
        if self.sigma < 0:
            raise ValueError(f"WorkloadConfig.sigma: must be >= 0, got {self.sigma}")
        for name in ("unique_token_frac", "task_corr", "failure_rate"):
            v = getattr(self, name)
            if not 0 <= v <= 1 or (name == "unique_token_frac" and v == 0):
                raise ValueError(f"WorkloadConfig.{name}: must be in (0, 1] / [0, 1], got {v}")

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
    rng = np.random.default_rng(seed)
    rho = config.task_corr
    z_task = np.repeat(rng.standard_normal(runs // group_size), group_size)
    z = rho * z_task + math.sqrt(1 - rho * rho) * rng.standard_normal(runs)
    d = np.minimum(config.median_run_h * np.exp(config.sigma * z), config.timeout_h)
    failed = rng.random(runs) < config.failure_rate
    d = np.where(failed, d * rng.uniform(0.05, 1.0, runs), d)
    tokens = d * config.tokens_per_run_h * config.unique_token_frac
    return Workload(tuple(d.tolist()), tuple(tokens.tolist()), group_size)
