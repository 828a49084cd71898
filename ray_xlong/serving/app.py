"""The OpenAI-compatible endpoint of a rollout cell: a thin routing / recording layer on an engine.

::

    POST /runs                          {"group_id", "run_id"?} -> {"run_id", "base_url"}
    GET  /runs/{run_id}/v1/models       the served model
    POST /runs/{run_id}/v1/chat/completions   vLLM's ChatCompletionRequest (messages, tools,
                                        tool_choice, temperature, max_tokens, stream, logprobs,
                                        return_token_ids); header X-Xlong-Agent
    POST /runs/{run_id}/v1/completions  a text or token-id prompt
    POST /runs/{run_id}/end             {"reward", "status"} -> the run as JSON lines
                                        (``trajectory/recording.py``: run line, call lines)
    POST /drain | /undrain, GET /health the cell's role

Requests and responses are vLLM's protocol models (``responses.py``); prompts are token-exact
(``prompts.py``); every answered request is one whole ``ModelCall`` (``runs.py``). A chat
request's messages that repeat its agent's previous request are not schema-checked again
(``_unvalidated``: the check's cost would grow with the history on every call).

Bad input is an HTTP error in OpenAI's shape ``{"error": {"message", "type", "code"}}``:
malformed JSON / schema failure / unsupported field / ``max_tokens`` past the context → 400;
unknown model → 404; unknown or ended run → 404 naming it; a run past its budget → 409 (one
nobody ends is reaped as ``timeout`` after twice its wall clock: ``RunRegistry.abandoned``);
new run on a draining cell → 503; more than ``max_queue`` generations in flight → 429 +
``Retry-After``; a run that ends with no call → 422 (it is recorded ``failed``). A client that
disconnects while its call generates cancels it: nothing is recorded.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from typing import Any

import numpy as np
import pydantic
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ray_xlong.checks import check_int
from ray_xlong.rollout.chat import ChatFormatError
from ray_xlong.rollout.engine import Engine, GenerateResult, SamplingConfig
from ray_xlong.rollout.template_format import TemplateFormat
from ray_xlong.serving import responses
from ray_xlong.serving.messages import AGENT_HEADER, MessageError, parse_agent_header
from ray_xlong.serving.prompts import build_prompt, next_context, normalize_request
from ray_xlong.serving.runs import (Draining, LiveRun, NoCallError, OverBudget, RunLimits,
                                    RunNotFound, RunRegistry)
from ray_xlong.trajectory.recording import run_records


class HTTPError(Exception):
    """An error answered in OpenAI's error shape."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error",
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.headers = status, message, kind, headers


class ClientGone(Exception):
    """The client disconnected while its call generated."""


@dataclasses.dataclass(frozen=True, slots=True)
class EndpointConfig:
    """One endpoint; validated at construction."""

    model_name: str = "xlong"
    """The name served under ``models`` (requests must name it)."""
    max_model_len: int = 4096
    """Context length: prompt + ``max_tokens`` must fit."""
    default_max_tokens: int = 256
    """``max_tokens`` of a request that gives none (capped by the context left)."""
    max_queue: int = 64
    """Generations in flight; one more is answered 429 with ``Retry-After``."""
    retry_after_s: int = 1
    """The ``Retry-After`` of a 429."""
    limits: RunLimits = RunLimits()
    """Budgets of each run."""
    disconnect_poll_s: float = 0.05
    """How often a generating call checks that its client is still there."""

    def __post_init__(self) -> None:
        for name in ("max_model_len", "default_max_tokens", "max_queue", "retry_after_s"):
            check_int("EndpointConfig", name, getattr(self, name), minimum=1)
        if not self.model_name:
            raise ValueError("EndpointConfig.model_name must be a non-empty string")


class Endpoint:
    """Serves runs on one engine (see module docstring)."""

    def __init__(self, engine: Engine, *, tokenizer: Any, fmt: TemplateFormat | None,
                 config: EndpointConfig = EndpointConfig(),
                 chat_error: str | None = None) -> None:
        """``chat_error``: why the model cannot chat (``fmt`` None), shown to chat requests."""
        self.engine, self.tokenizer, self.fmt, self.config = engine, tokenizer, fmt, config
        self.chat_error = chat_error or "this model has no chat template"
        self.runs = RunRegistry(limits=config.limits)
        self.url = ""
        """The public base URL (set by the server once bound)."""
        self.inflight = 0
        self.refused = 0
        self.cancelled = 0
        self.app = self._build()

    def base_url(self, run_id: str) -> str:
        """The OpenAI base URL of a run."""
        return f"{self.url}/runs/{run_id}/v1"

    # -- app --------------------------------------------------------------------------------
    def _build(self) -> FastAPI:
        app = FastAPI(title="ray_xlong endpoint")

        @app.exception_handler(HTTPError)
        async def _error(_: Request, exc: HTTPError) -> JSONResponse:
            body = {"error": {"message": exc.message, "type": exc.kind, "param": None,
                              "code": exc.status}}
            return JSONResponse(body, status_code=exc.status, headers=exc.headers)

        app.post("/runs")(self._open)
        app.get("/runs/{run_id}/v1/models")(self._models)
        app.post("/runs/{run_id}/v1/chat/completions")(self._chat)
        app.post("/runs/{run_id}/v1/completions")(self._completions)
        app.post("/runs/{run_id}/end")(self._end)
        app.post("/drain")(self._drain)
        app.post("/undrain")(self._undrain)
        app.get("/health")(self._health)
        return app

    async def _open(self, request: Request) -> dict:
        body = await _json(request)
        self.runs.reap()
        try:
            run = self.runs.open(group_id=body.get("group_id"), run_id=body.get("run_id"))
        except Draining as exc:
            raise HTTPError(503, str(exc), "cell_draining") from None
        except ValueError as exc:
            raise HTTPError(400, str(exc)) from None
        return {"run_id": run.run_id, "base_url": self.base_url(run.run_id)}

    async def _models(self, run_id: str) -> dict:
        self._run(run_id)
        from vllm.entrypoints.serve.engine.protocol import ModelCard, ModelList

        card = ModelCard(id=self.config.model_name, owned_by="ray_xlong",
                         max_model_len=self.config.max_model_len)
        return ModelList(data=[card]).model_dump(mode="json")

    async def _end(self, run_id: str, request: Request) -> Response:
        body = await _json(request)
        reward = body.get("reward", 0.0)
        if isinstance(reward, bool) or not isinstance(reward, (int, float)) \
                or not np.isfinite(reward):
            raise HTTPError(400, f"reward must be a finite number, got {reward!r}")
        try:
            run = self.runs.end(run_id, reward=float(reward),
                                status=body.get("status", "finished"))
        except RunNotFound as exc:
            raise HTTPError(404, str(exc), "run_not_found") from None
        except NoCallError as exc:
            raise HTTPError(422, str(exc), "run_without_calls") from None
        except ValueError as exc:
            raise HTTPError(400, str(exc)) from None
        lines = "".join(json.dumps(r, separators=(",", ":")) + "\n" for r in run_records(run))
        return Response(lines, media_type="application/jsonl")

    async def _drain(self) -> dict:
        self.runs.draining = True
        return {"draining": True, "live_runs": len(self.runs.live)}

    async def _undrain(self) -> dict:
        self.runs.draining = False
        return {"draining": False, "live_runs": len(self.runs.live)}

    async def _health(self) -> dict:
        self.runs.reap()
        return {"live_runs": len(self.runs.live), "draining": self.runs.draining,
                "inflight": self.inflight, "policy_version": self.engine.policy_version}

    # -- calls ------------------------------------------------------------------------------
    def _run(self, run_id: str) -> LiveRun:
        try:
            return self.runs.get(run_id)
        except RunNotFound as exc:
            raise HTTPError(404, str(exc), "run_not_found") from None

    def _prepare(self, run_id: str, request: Request, schema: type, body: dict):
        """The run, the agent tag and the validated request (errors as HTTPError)."""
        run = self._run(run_id)
        try:
            tag = parse_agent_header(request.headers.get(AGENT_HEADER))
            self.runs.check_parent(run, tag)
        except ValueError as exc:
            raise HTTPError(400, str(exc)) from None
        try:
            req = schema.model_validate(_unvalidated(body, run.validated.get(tag.agent_id)))
        except pydantic.ValidationError as exc:
            raise HTTPError(400, "request does not match the schema: " + "; ".join(
                f"{'.'.join(map(str, e['loc'])) or 'body'}: {e['msg']}"
                for e in exc.errors()[:5])) from None
        if req.model != self.config.model_name:
            raise HTTPError(404, f"model {req.model!r} does not exist; this endpoint serves "
                                 f"{self.config.model_name!r}", "model_not_found")
        if (req.n or 1) != 1:
            raise HTTPError(400, f"n must be 1, got {req.n}")
        if req.stop:
            raise HTTPError(400, "stop strings are not supported (outputs stay token-exact); "
                                 "use stop_token_ids")
        try:
            self.runs.admit(run)
        except OverBudget as exc:
            raise HTTPError(409, str(exc), "run_over_budget") from None
        return run, tag, req

    def _sampling(self, run: LiveRun, req, n_prompt: int, stops: tuple[int, ...]
                  ) -> SamplingConfig:
        limit = self.config.max_model_len
        if n_prompt >= limit:
            raise HTTPError(400, f"messages: the prompt has {n_prompt} tokens; the context "
                                 f"holds {limit}")
        want = getattr(req, "max_completion_tokens", None) or req.__dict__.get("max_tokens")
        if want is not None and (want < 1 or n_prompt + want > limit):
            raise HTTPError(400, f"max_tokens {want} is beyond the context: prompt "
                                 f"{n_prompt} + max_tokens must be <= {limit}")
        want = want or min(self.config.default_max_tokens, limit - n_prompt)
        left = self.runs.max_tokens_left(run)
        temperature = 1.0 if req.temperature is None else float(req.temperature)
        return SamplingConfig(max_tokens=max(1, min(want, left)), temperature=temperature,
                              stop_token_ids=tuple(sorted(set(stops) |
                                                          set(req.stop_token_ids or ()))),
                              seed=req.seed)

    async def _generate(self, request: Request, ids: np.ndarray,
                        sampling: SamplingConfig) -> GenerateResult:
        """Generate unless the queue is full (429) or the client leaves (ClientGone)."""
        if self.inflight >= self.config.max_queue:
            self.refused += 1
            raise HTTPError(429, f"{self.inflight} generations in flight (max_queue "
                                 f"{self.config.max_queue}); retry later", "rate_limit",
                            headers={"Retry-After": str(self.config.retry_after_s)})
        self.inflight += 1
        task = asyncio.ensure_future(self.engine.generate(ids, sampling=sampling))
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=self.config.disconnect_poll_s)
                if done:
                    return task.result()
                if await request.is_disconnected():
                    task.cancel()
                    self.cancelled += 1
                    raise ClientGone()
        except ValueError as exc:
            raise HTTPError(400, f"the engine rejected the prompt: {exc}") from None
        finally:
            self.inflight -= 1

    async def _chat(self, run_id: str, request: Request) -> Response:
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

        body = await _json(request)
        run, tag, req = self._prepare(run_id, request, ChatCompletionRequest, body)
        if self.fmt is None:
            raise HTTPError(400, f"this model cannot chat: {self.chat_error}; use completions")
        tools = tuple(t.model_dump(mode="json", exclude_none=True) for t in req.tools or ())
        try:
            previous = run.agents.get(tag.agent_id)     # as sent: the schema passed (above)
            messages = normalize_request(body["messages"], previous)
            prompt = build_prompt(self.fmt, previous, messages, tools)
        except (MessageError, ChatFormatError) as exc:
            raise HTTPError(400, str(exc)) from None
        run.validated[tag.agent_id] = body["messages"]
        sampling = self._sampling(run, req, int(prompt.ids.size), self.fmt.stop_token_ids)
        started = time.time()
        try:
            result = await self._generate(request, prompt.ids, sampling)
        except ClientGone:
            return Response(status_code=499)
        turn = responses.parse_turn(self.fmt, result,
                                    tools=tools if req.tool_choice != "none" else ())
        self.runs.record(run, tag, prompt.ids, result, started=started)
        run.extended += int(prompt.extends)
        run.rewrites += int(prompt.rewrite)
        if tag.agent_id == "main":
            run.last_answer = turn.content
        run.agents[tag.agent_id] = next_context(self.fmt, prompt, messages, turn.normal_form(),
                                                tools, result.output_ids, body["messages"])
        body = responses.chat_response(self.fmt, model=self.config.model_name,
                                       prompt_ids=prompt.ids, result=result, turn=turn,
                                       logprobs=bool(req.logprobs),
                                       token_ids=bool(req.return_token_ids))
        if req.stream:
            usage = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(responses.chat_stream(body, include_usage=usage),
                                     media_type="text/event-stream")
        return Response(body.model_dump_json(), media_type="application/json")

    async def _completions(self, run_id: str, request: Request) -> Response:
        from vllm.entrypoints.openai.completion.protocol import CompletionRequest

        run, tag, req = self._prepare(run_id, request, CompletionRequest, await _json(request))
        if req.stream:
            raise HTTPError(400, "stream is not supported on completions; use chat/completions")
        prompt = req.prompt
        if isinstance(prompt, str):
            ids = np.asarray(self.tokenizer.encode(prompt), np.int64)
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            ids = np.asarray(prompt, np.int64)
        else:
            raise HTTPError(400, "prompt must be one string or one list of token ids")
        if ids.size == 0 or int(ids.max()) >= self.engine.vocab_size:
            raise HTTPError(400, f"prompt: empty, or an id outside [0, "
                                 f"{self.engine.vocab_size})")
        stops = self.fmt.stop_token_ids if self.fmt is not None else ()
        sampling = self._sampling(run, req, int(ids.size), stops)
        started = time.time()
        try:
            result = await self._generate(request, ids, sampling)
        except ClientGone:
            return Response(status_code=499)
        self.runs.record(run, tag, ids, result, started=started)
        body = responses.completion_response(
            self.fmt, self.tokenizer, model=self.config.model_name, prompt_ids=ids,
            result=result, logprobs=req.logprobs is not None,
            token_ids=bool(req.return_token_ids))
        return Response(body.model_dump_json(), media_type="application/json")


def _unvalidated(body: dict, known: list | None) -> dict:
    """What of a request still needs the schema: a chat request's messages that repeat the
    agent's previous request's (validated then) are left out — validating vLLM's message union
    costs ~0.15 ms a message, so a long agent would pay for its whole history on every call.
    At least the last message is always validated (the schema wants one)."""
    msgs = body.get("messages")
    if not known or not isinstance(msgs, list) or len(msgs) < len(known) \
            or msgs[:len(known)] != known:
        return body
    return dict(body, messages=msgs[len(known):] or msgs[-1:])


async def _json(request: Request) -> dict:
    raw = await request.body()
    try:
        body = json.loads(raw or b"{}")
    except ValueError as exc:
        raise HTTPError(400, f"malformed JSON body: {exc}") from None
    if not isinstance(body, dict):
        raise HTTPError(400, f"the JSON body must be an object, got {type(body).__name__}")
    return body
