"""Seeded, paper-shaped synthetic agent runs for tests, benchmarks and examples.

A run is generated the way a harness records one: each agent owns a context buffer, preallocated
to its token budget; a call's ``input_ids`` is a view ``ctx[:n]`` and its output is written right
after it (``ctx[n:n+m]``), so the hundreds of calls of a run share one growing context and no
token is copied (the processor's zero-copy path). Events, each at seeded call positions:

* tool results of heavy-tailed (log-normal) length are appended after every call (context);
* **compaction**: when the main context passes ``context_budget``, a ``summary`` call (the main
  context + a summarize prompt) produces a summary, and the main agent continues from a new
  context ``[system, task, summary]`` (a new trajectory);
* **subagents**: a main call spawns a child agent (kind ``subagent``) with its own context and a
  few calls; its last output is appended to the main context as a tool result;
* **retries**: a malformed output is not appended (stored apart) and the same context is sent
  again;
* **timeouts / failures**: a run may stop early with status ``timeout`` (partial reward) or
  ``failed``.

``SyntheticConfig.paper()`` matches the reported scale: 636 calls, a context that grows to about
700k tokens, ~10 candidate trajectories. ``SyntheticConfig.small()`` is for property tests.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ray_xlong.trajectory.records import AgentRun, ModelCall


@dataclasses.dataclass(frozen=True, slots=True)
class SyntheticConfig:
    """Shape of generated runs."""

    num_calls: int = 40
    """Main-agent turns of a run that does not stop early (summary calls included; a run's
    total calls add ``num_retries`` and ``num_subagents × subagent_calls``)."""
    vocab_size: int = 1000
    """Token ids are drawn from ``[0, vocab_size)``."""
    system_tokens: int = 16
    """Length of the system prompt (shared by every run of a group)."""
    task_tokens: int = 16
    """Length of the task statement (shared by every run of a group)."""
    tool_tokens_mean: float = 20.0
    """Mean length of a tool result (log-normal)."""
    output_tokens_mean: float = 8.0
    """Mean length of a model output (log-normal)."""
    tail_sigma: float = 0.8
    """Log-normal sigma of tool / output lengths (heavier tail when larger)."""
    context_budget: int = 400
    """Compaction threshold of the main context, in tokens."""
    summary_tokens: int = 12
    """Length of a summary output."""
    num_subagents: int = 1
    """Subagents spawned by the main agent."""
    subagent_calls: int = 3
    """Calls per subagent."""
    num_retries: int = 1
    """Malformed outputs followed by a retry from the same context."""
    timeout_prob: float = 0.2
    """Probability that a run times out (stops at a random call, partial reward)."""
    failed_prob: float = 0.05
    """Probability that a run fails (environment error)."""

    @classmethod
    def paper(cls) -> "SyntheticConfig":
        """636 calls, context growing to ~700k tokens, compactions, subagents, retries."""
        return cls(num_calls=597,                      # + 3 retries + 3 × 12 subagent calls = 636 vocab_size=150_000, system_tokens=4000, task_tokens=2000,
                   tool_tokens_mean=1500.0, output_tokens_mean=420.0, tail_sigma=1.0,
                   context_budget=700_000, summary_tokens=4000, num_subagents=3,
                   subagent_calls=12, num_retries=3, timeout_prob=0.0, failed_prob=0.0)

    @classmethod
    def small(cls) -> "SyntheticConfig":
        """Tiny runs with every event (property tests)."""
        return cls(num_calls=12, vocab_size=20, system_tokens=3, task_tokens=2,
                   tool_tokens_mean=3.0, output_tokens_mean=3.0, tail_sigma=0.6,
                   context_budget=40, summary_tokens=3, num_subagents=1, subagent_calls=2,
                   num_retries=1, timeout_prob=0.2, failed_prob=0.1)


class _Context:
    """A preallocated token buffer; calls see views of it (no copies)."""

    def __init__(self, capacity: int, prefix: np.ndarray) -> None:
        self.buf = np.zeros(capacity, dtype=np.int32)
        self.n = 0
        self.append(prefix)

    def append(self, tokens: np.ndarray) -> None:
        if self.n + tokens.size > self.buf.size:
            raise ValueError(f"synthetic context overflow: {self.n + tokens.size} > "
                             f"{self.buf.size}; raise context_budget")
        self.buf[self.n:self.n + tokens.size] = tokens
        self.n += tokens.size

    def view(self, start: int = 0, stop: int | None = None) -> np.ndarray:
        return self.buf[start:self.n if stop is None else stop]


class _Gen:
    """Generates one run's calls."""

    def __init__(self, rng: np.random.Generator, cfg: SyntheticConfig, run_id: str,
                 prefix: np.ndarray, version: int) -> None:
        self.rng, self.cfg, self.run_id, self.prefix = rng, cfg, run_id, prefix
        self.version = version
        self.calls: list[ModelCall] = []

    def tokens(self, mean: float) -> np.ndarray:
        n = max(1, int(self.rng.lognormal(np.log(mean), self.cfg.tail_sigma)))
        return self.rng.integers(0, self.cfg.vocab_size, n, dtype=np.int32)

    def call(self, ctx: _Context, agent: str, kind: str, out: np.ndarray, *,
             parent: str | None = None, append: bool = True) -> np.ndarray:
        """Record a call on ``ctx``; its output is appended unless ``append`` is False."""
        n = ctx.n
        logprobs = -self.rng.exponential(0.5, out.size).astype(np.float32)
        if append:
            ctx.append(out)
            out_view = ctx.view(n, n + out.size)
        else:
            out_view = out
        self.calls.append(ModelCall(f"{self.run_id}/c{len(self.calls)}", agent, kind,
                                    ctx.view(0, n), out_view, logprobs, self.version,
                                    parent_agent_id=parent, run_id=self.run_id))
        return out_view

    def capacity(self, extra: int) -> int:
        c = self.cfg
        return c.context_budget + 40 * int(c.tool_tokens_mean + c.output_tokens_mean) + extra

    def subagent(self, index: int) -> np.ndarray:
        cfg = self.cfg
        ctx = _Context(self.capacity(cfg.system_tokens), self.prefix[:cfg.system_tokens])
        ctx.append(self.tokens(cfg.tool_tokens_mean))
        out = np.zeros(0, np.int32)
        for _ in range(cfg.subagent_calls):
            out = self.call(ctx, f"sub{index}", "subagent", self.tokens(cfg.output_tokens_mean),
                            parent="main")
            ctx.append(self.tokens(cfg.tool_tokens_mean))
        return np.array(out)

    def main(self, stop_at: int) -> None:
        cfg, rng = self.cfg, self.rng
        ctx = _Context(self.capacity(self.prefix.size), self.prefix)
        spawn_at = set(rng.choice(cfg.num_calls, cfg.num_subagents, replace=False).tolist())
        retry_at = set(rng.choice(cfg.num_calls, cfg.num_retries, replace=False).tolist())
        for i in range(stop_at):
            if ctx.n > cfg.context_budget:
                ctx.append(self.tokens(4.0))                       # the summarize prompt
                summary = np.array(self.call(ctx, "main", "summary",
                                             self.tokens(cfg.summary_tokens)))
                ctx = _Context(self.capacity(self.prefix.size), self.prefix)
                ctx.append(summary)
                continue
            if i in retry_at:
                self.call(ctx, "main", "main", self.tokens(cfg.output_tokens_mean), append=False)
            self.call(ctx, "main", "main", self.tokens(cfg.output_tokens_mean))
            if i in spawn_at:
                ctx.append(self.subagent(len(self.calls)))
            else:
                ctx.append(self.tokens(cfg.tool_tokens_mean))


def synthetic_run(rng: np.random.Generator, *, run_id: str, group_id: str,
                  config: SyntheticConfig, prefix: np.ndarray | None = None,
                  policy_version: int = 0) -> AgentRun:
    """One run (see module docstring).

    Args:
        rng: the random source (the run is a function of its state).
        run_id / group_id: ids of the run.
        config: the shape.
        prefix: ``[system + task]`` tokens (drawn when None); runs of a group share it.
        policy_version: the version recorded on every call.
    """
    cfg = config
    if prefix is None:
        prefix = rng.integers(0, cfg.vocab_size, cfg.system_tokens + cfg.task_tokens,
                              dtype=np.int32)
    u = rng.random()
    status = "failed" if u < cfg.failed_prob else (
        "timeout" if u < cfg.failed_prob + cfg.timeout_prob else "finished")
    stop_at = cfg.num_calls if status == "finished" else int(rng.integers(1, cfg.num_calls + 1))
    gen = _Gen(rng, cfg, run_id, prefix, policy_version)
    gen.main(stop_at)
    reward = float(rng.random()) * (0.5 if status == "timeout" else 1.0)
    return AgentRun(run_id, group_id, gen.calls, reward, status)


def synthetic_runs(seed: int, *, groups: int = 2, runs_per_group: int = 4,
                   config: SyntheticConfig = SyntheticConfig(),
                   policy_version: int = 0) -> list[AgentRun]:
    """``groups × runs_per_group`` runs; the runs of a group share their system + task prefix."""
    rng = np.random.default_rng(seed)
    runs = []
    for g in range(groups):
        prefix = rng.integers(0, config.vocab_size, config.system_tokens + config.task_tokens,
                              dtype=np.int32)
        for r in range(runs_per_group):
            runs.append(synthetic_run(rng, run_id=f"g{g}r{r}", group_id=f"g{g}", config=config,
                                      prefix=prefix, policy_version=policy_version))
    return runs
