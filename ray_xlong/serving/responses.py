"""Engine results as OpenAI responses, in vLLM's own protocol models.

One chat result becomes a ``ChatCompletionResponse`` (or its ``chat.completion.chunk`` stream);
``return_token_ids`` adds the prompt ids as ``prompt_token_ids`` and each choice's output ids
as ``token_ids`` (vLLM's names). Reasoning is split off by the format's vLLM reasoning parser
and returned as ``reasoning_content`` (and vLLM's own ``reasoning``), never in ``content``; tool
calls are parsed by the format's vLLM tool parser from the text after the reasoning; a turn
that fails to parse is returned as text (the agent sees what the model wrote). A stream carries
the whole result: role, then text + ``token_ids`` + logprobs, then tool calls, then the finish
reason (+ usage when ``stream_options.include_usage``), then ``[DONE]``.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
from typing import Iterator, Sequence

import numpy as np
from vllm.entrypoints.openai.chat_completion.protocol import (
    ChatCompletionLogProbs, ChatCompletionLogProbsContent, ChatCompletionResponse,
    ChatCompletionResponseChoice, ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse, ChatMessage)
from vllm.entrypoints.openai.completion.protocol import (CompletionLogProbs,
                                                         CompletionResponse,
                                                         CompletionResponseChoice)
from vllm.entrypoints.generate.base.protocol import (DeltaFunctionCall, DeltaMessage,
                                                     DeltaToolCall, FunctionCall, ToolCall)
from vllm.entrypoints.serve.engine.protocol import UsageInfo

from ray_xlong.rollout.chat import Malformed
from ray_xlong.rollout.engine import GenerateResult
from ray_xlong.rollout.template_format import TemplateFormat

_IDS = itertools.count()
_PREFIX = f"{os.getpid():x}"      # ids unique per process; uuid4 costs ~1 ms a call here


def _new_id(kind: str) -> str:
    return f"{kind}-{_PREFIX}-{next(_IDS)}"


@dataclasses.dataclass(frozen=True, slots=True)
class Turn:
    """An output parsed into what the agent is shown."""

    content: str
    """Text (without the end-of-turn id)."""
    calls: tuple[tuple[str, object], ...]
    """``(name, arguments)`` per tool call."""
    finish_reason: str
    """``tool_calls`` | ``stop`` | ``length``."""
    reasoning: str = ""
    """The turn's reasoning (empty for models without; never part of ``content``)."""
    ids: tuple[str, ...] = ()
    """The calls' ids as returned: the model's own (Mistral), else fresh ones."""

    def normal_form(self) -> dict:
        """The assistant message in ``messages.normalize`` form."""
        msg: dict = {"role": "assistant", "content": self.content}
        if self.calls:
            msg["tool_calls"] = list(self.calls)
            msg["tool_call_ids"] = list(self.ids)
        if self.reasoning:
            msg["reasoning_content"] = self.reasoning
        return msg


def parse_turn(fmt: TemplateFormat, result: GenerateResult, *, tools: Sequence[dict]) -> Turn:
    """Split an output into reasoning, text and tool calls (``tools``: the schemas the request
    offered, empty for none or ``tool_choice="none"``)."""
    ids = [int(t) for t in result.output_ids]
    if ids and ids[-1] in fmt.stop_token_ids:
        ids = ids[:-1]
    text, reasoning = fmt.decode(ids), ""
    if fmt.reasoning is not None and result.finish_reason == "stop":
        split = fmt.reasoning.split(text)
        if not isinstance(split, Malformed):
            reasoning, text = split[0], split[1].strip()
    if tools and fmt.parser is not None and result.finish_reason == "stop":
        parsed = fmt.parser.parse_with_ids(text, tools)
        if not isinstance(parsed, Malformed) and parsed[0]:
            calls = tuple((c.name, c.arguments) for c in parsed[0])
            ids = parsed[2] or tuple(_new_id("call") for _ in calls)
            return Turn(parsed[1].strip() if reasoning else parsed[1], calls, "tool_calls",
                        reasoning, ids)
    return Turn(text, (), result.finish_reason, reasoning)


def _usage(n_prompt: int, result: GenerateResult) -> UsageInfo:
    n_out = int(result.output_ids.size)
    return UsageInfo(prompt_tokens=n_prompt, completion_tokens=n_out,
                     total_tokens=n_prompt + n_out)


def _logprobs(fmt: TemplateFormat, result: GenerateResult) -> ChatCompletionLogProbs:
    content = []
    for tok, lp in zip(result.output_ids.tolist(), result.output_logprobs.tolist()):
        text = fmt.decode(np.asarray([tok]))
        content.append(ChatCompletionLogProbsContent(token=text, logprob=lp,
                                                     bytes=list(text.encode("utf-8"))))
    return ChatCompletionLogProbs(content=content)


def _tool_calls(turn: Turn) -> list[ToolCall]:
    return [ToolCall(id=turn.ids[i] if i < len(turn.ids) else _new_id("call"),
                     function=FunctionCall(name=name, arguments=json.dumps(args)))
            for i, (name, args) in enumerate(turn.calls)]


def chat_response(fmt: TemplateFormat, *, model: str, prompt_ids: np.ndarray,
                  result: GenerateResult, turn: Turn, logprobs: bool, token_ids: bool
                  ) -> ChatCompletionResponse:
    """The non-streaming chat response."""
    extra = {"reasoning": turn.reasoning, "reasoning_content": turn.reasoning} \
        if turn.reasoning else {}
    message = ChatMessage(role="assistant", content=turn.content or None if turn.calls
                          else turn.content, tool_calls=_tool_calls(turn), **extra)
    choice = ChatCompletionResponseChoice(
        index=0, message=message, finish_reason=turn.finish_reason,
        logprobs=_logprobs(fmt, result) if logprobs else None,
        token_ids=result.output_ids.tolist() if token_ids else None)
    return ChatCompletionResponse(
        id=_new_id("chatcmpl"), model=model, choices=[choice],
        usage=_usage(int(prompt_ids.size), result),
        prompt_token_ids=prompt_ids.tolist() if token_ids else None)


def chat_stream(response: ChatCompletionResponse, *, include_usage: bool) -> Iterator[str]:
    """Server-sent events of a finished response (see module docstring)."""
    choice = response.choices[0]
    msg = choice.message

    def chunk(delta: DeltaMessage, **extra) -> str:
        usage = extra.pop("usage", None)
        prompt = extra.pop("prompt_token_ids", None)
        c = ChatCompletionResponseStreamChoice(index=0, delta=delta, **extra)
        body = ChatCompletionStreamResponse(id=response.id, created=response.created,
                                            model=response.model, choices=[c], usage=usage,
                                            prompt_token_ids=prompt)
        return f"data: {body.model_dump_json(exclude_none=True)}\n\n"

    yield chunk(DeltaMessage(role="assistant", content=""),
                prompt_token_ids=response.prompt_token_ids)
    if msg.reasoning:
        yield chunk(DeltaMessage(reasoning=msg.reasoning, reasoning_content=msg.reasoning))
    yield chunk(DeltaMessage(content=msg.content or ""), token_ids=choice.token_ids,
                logprobs=choice.logprobs)
    if msg.tool_calls:
        yield chunk(DeltaMessage(tool_calls=[
            DeltaToolCall(index=i, id=tc.id, type="function",
                          function=DeltaFunctionCall(name=tc.function.name,
                                                     arguments=tc.function.arguments))
            for i, tc in enumerate(msg.tool_calls)]))
    yield chunk(DeltaMessage(), finish_reason=choice.finish_reason)
    if include_usage:
        body = ChatCompletionStreamResponse(id=response.id, created=response.created,
                                            model=response.model, choices=[],
                                            usage=response.usage)
        yield f"data: {body.model_dump_json(exclude_none=True)}\n\n"
    yield "data: [DONE]\n\n"


def completion_response(fmt: TemplateFormat | None, tokenizer, *, model: str,
                        prompt_ids: np.ndarray, result: GenerateResult, logprobs: bool,
                        token_ids: bool) -> CompletionResponse:
    """The (non-streaming) text completion response."""
    out = result.output_ids.tolist()
    text = tokenizer.decode(out, skip_special_tokens=False)
    lps = None
    if logprobs:
        tokens = [tokenizer.decode([t], skip_special_tokens=False) for t in out]
        lps = CompletionLogProbs(tokens=tokens, token_logprobs=result.output_logprobs.tolist(),
                                 text_offset=list(np.cumsum([0] + [len(t) for t in tokens])[:-1]
                                                  .tolist()),
                                 top_logprobs=[None] * len(out))
    choice = CompletionResponseChoice(
        index=0, text=text, logprobs=lps, finish_reason=result.finish_reason,
        token_ids=out if token_ids else None,
        prompt_token_ids=prompt_ids.tolist() if token_ids else None)
    return CompletionResponse(id=_new_id("cmpl"), model=model, choices=[choice],
                              usage=_usage(int(prompt_ids.size), result))
