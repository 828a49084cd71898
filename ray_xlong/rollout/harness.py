"""The agent harness: many concurrent agent runs against one engine, every call token-exact.

One run (``Harness.run``) is an asyncio task::

    main agent loop (agent "main", kind main)                     budgets checked before each call
      ├─ context + pending delta > compaction_budget ─► summary call (kind summary) on context +
      │                                 the format's summary request; continue from prompt +
      │                                 <its ids> (new trajectory)
      ├─ ctx += conv.delta() ; engine.generate(ctx[:n]) ─► output ─► conv.parse (``chat.py``)
      │     malformed, retries left ─► recorded, not appended; same context again (retry)
      │     malformed, none left    ─► appended + an error tool result
      │     tool calls (one or more) ─► each in order: unknown tool / arguments failing the
      │                                tool's JSON schema → an error result; subagent(task) →
      │                                child agent "subN" (kind subagent, parent = caller) with
      │                                its own context, its answer is the result; else
      │                                env.call_tool(name, arguments dict) under tool_timeout_s
      │                                (crash / timeout → an error result); each result cut to
      │                                max_tool_output_tokens, one tool message per call
      │     answer                  ─► env.submit(text); the run is finished
      └─ engine error ─► retried up to max_engine_retries, then the run is failed

Ends: ``finished`` (answer), ``timeout`` (wall clock, generated-token budget, call budget or a
full context: scored on the partial state), ``failed`` (engine or environment broke, or scoring
failed; reward 0). ``RunInfo.error`` says why a run failed.

Hard inputs (each a recorded outcome, never a hang, a crash of ``run_many`` or a silent drop):

* tool hangs: cut at ``tool_timeout_s`` without waiting for the tool to honour its
  cancellation (``limits.bounded``); a tool that swallows ``CancelledError`` is abandoned, not awaited.
  An ``async`` ``call_tool`` must not block the event loop (it is shared by all runs); a *sync*
  ``call_tool`` is allowed and runs in its own daemon thread, so one that blocks forever costs a
  thread, never the loop or the shared executor the engine uses (``limits.in_thread``);
* tool raises (``ToolError`` or anything else): an ``error: ...`` tool result, the run goes on
  (``RunInfo.tool_errors``); ``TaskFailure`` fails the run;
* tool floods: cut to ``max_tool_output_tokens`` ids with a ``[truncated]`` marker
  (``RunInfo.tool_truncations``); only a bounded head of the text is tokenized;
* engine raises or returns a malformed result (logprob count, NaN, negative id): retried up to
  ``max_engine_retries`` times, then ``failed`` / ``engine_error`` with the error; a
  ``ValueError`` (a request the engine rejects) fails at once;
* a turn the chat template refuses to render (e.g. two calls where it allows one): malformed,
  with the template's reason; any other template refusal: ``failed`` / ``chat_format``;
* ``reset`` / ``submit`` raise: ``failed`` / ``task_failure``; ``score`` raises, hangs past
  ``score_timeout_s`` or is not finite: ``failed`` / ``score_error``.

Token exactness: a call's ``input_ids`` is the view ``ctx[:n]`` of the agent's buffer that was
sent to the engine, its ``output_ids`` the engine's ids (a view of the buffer once appended, the
engine's own array for a retried output); nothing the model generated is ever re-tokenized.
Environment messages enter as the chat format's deltas (``RunInfo.template_rewrites`` counts
deltas taken while a template rewrote history).
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import time
from typing import Any, Callable

import numpy as np

from ray_xlong.rollout.chat import (Answer, ChatFormat, ChatFormatError, Conversation,
                                    Malformed, ToolCall, ToolCalls)
from ray_xlong.rollout.context import Context, ContextFull
from ray_xlong.rollout.engine import Engine, EngineError, GenerateResult, SamplingConfig
from ray_xlong.rollout.limits import bounded, call_tool, in_thread
from ray_xlong.rollout.run_records import HarnessConfig, RunInfo, RunResult
from ray_xlong.rollout.tasks.base import TaskEnv, TaskFailure, ToolError
from ray_xlong.rollout.tool_calls import as_schema, check_call, function_schema
from ray_xlong.trajectory import AgentRun, ModelCall, RecordError
from ray_xlong.trajectory.records import as_logprobs, as_token_array


SUBAGENT_TOOL = function_schema(
    "subagent", "Hand a subtask to a subagent; its answer is the result.",
    {"task": {"type": "string", "description": "The subtask."}})
"""The harness's own tool (offered while ``max_subagent_depth`` allows)."""


class _Stop(Exception):
    """Ends a run early with a status and a stop reason."""

    def __init__(self, status: str, reason: str, error: str | None = None) -> None:
        super().__init__(reason)
        self.status, self.reason, self.error = status, reason, error


@dataclasses.dataclass(slots=True)
class _Agent:
    agent_id: str
    kind: str
    parent: str | None
    depth: int
    conv: Conversation
    ctx: Context
    max_calls: int
    tools: tuple[dict, ...]


class _RunState:
    """Mutable state of one run (calls recorded so far, counters, budgets)."""

    def __init__(self, run_id: str, config: HarnessConfig) -> None:
        self.run_id, self.config = run_id, config
        self.calls: list[ModelCall] = []
        self.start = time.monotonic()
        self.generated = 0
        self.counts = dict(retries=0, engine_retries=0, compactions=0, subagents=0,
                           tool_errors=0, tool_truncations=0, template_rewrites=0, turns=0,
                           tool_calls=0, malformed=0)

    def record(self, agent: _Agent, kind: str, inp: np.ndarray, out: np.ndarray,
               result: GenerateResult, started: float) -> None:
        parent = agent.parent if kind == agent.kind else None
        self.calls.append(ModelCall(
            f"{self.run_id}/c{len(self.calls)}", agent.agent_id, kind, inp, out,
            result.output_logprobs, result.policy_version, parent_agent_id=parent,
            start_time=started, end_time=time.time(), run_id=self.run_id))

    def max_tokens(self, want: int) -> int:
        left = self.config.max_run_tokens - self.generated
        if left <= 0:
            raise _Stop("timeout", "token_budget")
        return min(want, left)


class Harness:
    """Runs agent runs against one engine (see module docstring)."""

    def __init__(self, engine: Engine, chat: ChatFormat, *,
                 config: HarnessConfig = HarnessConfig()) -> None:
        self.engine, self.chat, self.config = engine, chat, config

    async def run(self, env: TaskEnv, *, run_id: str, group_id: str) -> RunResult:
        """One run of ``env`` to its end; never raises for agent, tool or engine trouble."""
        state = _RunState(run_id, self.config)
        status, reason, error = "finished", "answer", None
        try:
            obs = _task_step(env.reset, "reset")
            main = self._new_agent(env, "main", "main", None, 0, obs.system, obs.prompt,
                                   self.config.max_calls)
            answer = await bounded(self._agent(state, env, main), self.config.wall_clock_s)
            if answer is None:
                raise _Stop("timeout", "call_budget")
            _task_step(env.submit, "submit", answer)
        except _Stop as stop:
            status, reason, error = stop.status, stop.reason, stop.error
        except asyncio.TimeoutError:
            status, reason = "timeout", "wall_clock"
        except ContextFull:
            status, reason = "timeout", "context_full"
        except TaskFailure as exc:
            status, reason, error = "failed", "task_failure", repr(exc)
        except ChatFormatError as exc:              # the chat template refused a render
            status, reason, error = "failed", "chat_format", str(exc)
        reward = 0.0
        if status != "failed":
            try:
                reward = await self._score(env)
            except _Stop as stop:
                status, reason, error = stop.status, stop.reason, stop.error
        info = RunInfo(reason, elapsed_s=time.monotonic() - state.start, error=error,
                       **state.counts)
        return RunResult(AgentRun(run_id, group_id, state.calls, reward, status), info)

    async def _score(self, env: TaskEnv) -> float:
        """``env.score()`` in its own thread under ``score_timeout_s``; trouble → _Stop."""
        limit = self.config.score_timeout_s
        try:
            score = float(await bounded(in_thread(env.score), limit))
        except asyncio.TimeoutError:
            raise _Stop("failed", "score_error", f"env.score took over {limit:g} s") from None
        except Exception as exc:  # noqa: BLE001 - recorded on the run
            raise _Stop("failed", "score_error", f"env.score raised {exc!r}") from exc
        if not math.isfinite(score):
            raise _Stop("failed", "score_error", f"env.score must be finite, got {score}")
        return score

    def _new_agent(self, env: TaskEnv, agent_id: str, kind: str, parent: str | None,
                   depth: int, system: str, user: str, max_calls: int) -> _Agent:
        """An agent with its conversation and context; the subagent tool while depth allows."""
        tools = tuple(as_schema(t) for t in env.tools)
        if depth < self.config.max_subagent_depth:
            tools += (SUBAGENT_TOOL,)
        conv = self.chat.start(system, user, tools=tools)
        return _Agent(agent_id, kind, parent, depth, conv,
                      Context(conv.prompt_ids, capacity=self.config.context_capacity),
                      max_calls, tools)

    def _append_delta(self, state: _RunState, agent: _Agent, *, summarize: bool = False
                      ) -> None:
        """Append the conversation's pending environment messages (its rewrites counted)."""
        before = agent.conv.rewrites
        delta = agent.conv.delta(summarize=summarize)
        state.counts["template_rewrites"] += agent.conv.rewrites - before
        if delta.size:
            agent.ctx.append(delta)

    async def _agent(self, state: _RunState, env: TaskEnv, agent: _Agent) -> str | None:
        """Loop one agent until it answers (its answer) or runs out of calls (None)."""
        retries, calls = 0, 0
        while calls < agent.max_calls:
            calls += 1
            pending = agent.conv.delta(commit=False)
            if agent.ctx.n + pending.size > self.config.compaction_budget:
                await self._compact(state, agent)
                continue
            self._append_delta(state, agent)
            inp = agent.ctx.view()
            result, started = await self._generate(state, inp, self.config.max_new_tokens)
            action = agent.conv.parse(result.output_ids)
            state.counts["malformed"] += isinstance(action, Malformed)
            if isinstance(action, Malformed) and retries < self.config.max_retries:
                retries += 1
                state.counts["retries"] += 1
                state.record(agent, agent.kind, inp, result.output_ids, result, started)
                continue
            retries = 0
            out = agent.ctx.append(result.output_ids)
            state.record(agent, agent.kind, inp, out, result, started)
            agent.conv.add_output(out, action)
            state.counts["turns"] += agent.agent_id == "main"
            if isinstance(action, Answer):
                return action.text
            texts = await self._act(state, env, agent, action)
            state.counts["tool_truncations"] += agent.conv.add_tool_results(
                texts, max_tokens=self.config.max_tool_output_tokens)
        return None

    async def _act(self, state: _RunState, env: TaskEnv, agent: _Agent,
                   action: ToolCalls | Malformed) -> list[str]:
        """One result text per call, in order (errors become text the agent sees)."""
        if isinstance(action, Malformed):
            return [f"error: malformed output ({action.reason})"]
        return [await self._call(state, env, agent, call) for call in action.calls]

    async def _call(self, state: _RunState, env: TaskEnv, agent: _Agent,
                    call: ToolCall) -> str:
        """The result text of one call: checked against its schema, then run under limits."""
        state.counts["tool_calls"] += 1
        if call.name == "subagent" and agent.depth >= self.config.max_subagent_depth:
            state.counts["tool_errors"] += 1
            return "error: subagents may not start subagents here"
        error = check_call(call, agent.tools)
        if error is not None:
            state.counts["tool_errors"] += 1
            return error
        if call.name == "subagent":
            return await self._subagent(state, env, agent, str(call.arguments["task"]))
        try:
            return str(await bounded(call_tool(env, call.name, dict(call.arguments)),
                                      self.config.tool_timeout_s))
        except TaskFailure:
            raise
        except asyncio.TimeoutError:
            state.counts["tool_errors"] += 1
            return f"error: tool {call.name} timed out after {self.config.tool_timeout_s:g} s"
        except ToolError as exc:
            state.counts["tool_errors"] += 1
            return f"error: {exc}"
        except Exception as exc:  # noqa: BLE001 - a crashing tool is the agent's problem
            state.counts["tool_errors"] += 1
            return f"error: tool {call.name} crashed: {exc!r}"

    async def _subagent(self, state: _RunState, env: TaskEnv, parent: _Agent,
                        task_text: str) -> str:
        if parent.depth >= self.config.max_subagent_depth:
            state.counts["tool_errors"] += 1
            return "error: subagents may not start subagents here"
        state.counts["subagents"] += 1
        child = self._new_agent(env, f"sub{state.counts['subagents']}", "subagent",
                                parent.agent_id, parent.depth + 1, "You are a subagent.",
                                f"Subtask: {task_text}", self.config.subagent_max_calls)
        answer = await self._agent(state, env, child)
        return answer if answer is not None else "error: the subagent gave no answer"

    async def _compact(self, state: _RunState, agent: _Agent) -> None:
        """Summary call on the context + the summary request; continue from prompt + summary."""
        state.counts["compactions"] += 1
        self._append_delta(state, agent, summarize=True)
        inp = agent.ctx.view()
        result, started = await self._generate(state, inp, self.config.summary_max_tokens)
        out = agent.ctx.append(result.output_ids)
        state.record(agent, "summary", inp, out, result, started)
        fresh, agent.conv = agent.conv.compacted(np.asarray(out))
        agent.ctx = Context(fresh, capacity=self.config.context_capacity)

    async def _generate(self, state: _RunState, inp: np.ndarray,
                        want: int) -> tuple[GenerateResult, float]:
        """One engine call with retries on engine errors; counts generated tokens."""
        max_tokens = state.max_tokens(want)
        sampling = SamplingConfig(max_tokens=max_tokens, temperature=self.config.temperature,
                                  stop_token_ids=self.chat.stop_token_ids)
        for attempt in range(self.config.max_engine_retries + 1):
            started = time.time()
            try:
                result = await self.engine.generate(inp, sampling=sampling)
                _check_result(result, max_tokens=max_tokens)
            except ValueError as exc:  # the engine rejected the request: retrying cannot help
                raise _Stop("failed", "engine_error", repr(exc)) from exc
            except Exception as exc:  # noqa: BLE001 - EngineError, a dead actor, a bad result
                if attempt == self.config.max_engine_retries:
                    raise _Stop("failed", "engine_error", repr(exc)) from exc
                state.counts["engine_retries"] += 1
                continue
            state.generated += int(result.output_ids.size)
            return result, started
        raise AssertionError("unreachable")

    async def run_many(self, envs: list[TaskEnv], *, run_ids: list[str],
                       group_ids: list[str]) -> list[RunResult]:
        """Run ``envs`` concurrently (one run each); results in input order."""
        if not len(envs) == len(run_ids) == len(group_ids):
            raise ValueError("run_many: envs, run_ids and group_ids must have one entry each")
        return list(await asyncio.gather(*(self.run(e, run_id=r, group_id=g)
                                           for e, r, g in zip(envs, run_ids, group_ids))))


def _check_result(result: GenerateResult, *, max_tokens: int) -> None:
    """Raise :class:`EngineError` when an engine answer could not be recorded token-exactly."""
    try:
        out = as_token_array(result.output_ids, field="output_ids", where="engine result",
                             allow_empty=True)
        as_logprobs(result.output_logprobs, n=out.size, where="engine result")
        version = result.policy_version
    except RecordError as exc:
        raise EngineError(f"malformed engine result: {exc}") from None
    if isinstance(version, bool) or not isinstance(version, (int, np.integer)) or version < 0:
        raise EngineError(f"malformed engine result: policy_version {version!r}")
    if out.size > max_tokens:
        raise EngineError(f"malformed engine result: {out.size} output ids for max_tokens "
                          f"{max_tokens}")


def _task_step(fn: Callable[..., Any], name: str, *args: Any) -> Any:
    """Call a task method; anything it raises but :class:`TaskFailure` becomes one."""
    try:
        return fn(*args)
    except TaskFailure:
        raise
    except Exception as exc:  # noqa: BLE001 - a broken environment fails its run only
        raise TaskFailure(f"env.{name} raised {exc!r}") from exc
