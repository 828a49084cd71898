"""Token-exact prompts for an external agent's chat requests.

An agent's context is a buffer of ids, as in the harness. A request *extends* the agent's
previous request when its messages are the previous messages + the assistant message as it was
returned + new messages (tools unchanged). Then, and only then::

    prompt = previous prompt ids ++ previous output ids (exactly as sampled)
             ++ encode(delta of the new messages)          (TemplateFormat.delta_text: what the
                                                            template appends to what the model saw)

so no history is re-rendered and no model output re-tokenized, and the run's calls chain into
one trajectory. Anything else (an edited or compacted history, other tools, a first request)
renders the whole conversation afresh with the tokenizer's chat template; the prefix tree
branches there. Where the template's render does not start with what the model saw (it rewrites
history: Qwen3 drops an earlier think block once a user turn follows) the delta is what the
template renders after the last assistant turn (``TemplateFormat.delta_after_last_turn``) and
:attr:`Prompt.rewrite` says so. An assistant message echoed back without its
``reasoning_content`` still extends (the reasoning is in the context ids already).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from ray_xlong.rollout.chat import ChatFormatError
from ray_xlong.rollout.template_format import TemplateFormat
from ray_xlong.serving.messages import render_message


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class AgentContext:
    """What the endpoint keeps of an agent's previous request."""

    messages: tuple[dict, ...]
    """The request's messages (normal form) + the assistant message returned."""
    tools: tuple
    """The request's tools (as sent)."""
    context_ids: np.ndarray
    """``[n]`` prompt ids ++ output ids, exactly as sent to / sampled by the engine."""
    open: bool
    """Whether the output ended without an end-of-turn id (cut off by ``max_tokens``)."""


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class Prompt:
    """The ids of one chat request."""

    ids: np.ndarray
    """``[n]`` the ids sent to the engine."""
    extends: bool
    """True: previous context ++ delta; False: rendered afresh."""
    rewrite: bool = False
    """The delta was taken while the template rewrote history."""


def render_ids(fmt: TemplateFormat, messages: Sequence[dict], tools: Sequence[dict]
               ) -> np.ndarray:
    """The whole conversation rendered by the chat template (+ the generation prompt)."""
    try:
        text = fmt.tokenizer.apply_chat_template([render_message(m) for m in messages],
                                                 tools=list(tools) or None, tokenize=False,
                                                 add_generation_prompt=True)
    except Exception as exc:  # noqa: BLE001 - the request's fault: name it
        raise ChatFormatError(f"messages: the chat template failed to render them: {exc}") \
            from exc
    return fmt.encode(text)


def build_prompt(fmt: TemplateFormat, previous: AgentContext | None, messages: list[dict],
                 tools: Sequence[dict]) -> Prompt:
    """The prompt of a request (see module docstring).

    Args:
        fmt: the template format of the served model.
        previous: the agent's previous request, or None.
        messages: this request's messages, normal form.
        tools: this request's tools.
    """
    if previous is not None and tuple(tools) == previous.tools:
        n = len(previous.messages)
        new = messages[n:]
        if len(messages) > n and _same(previous.messages, messages[:n]) \
                and all(m["role"] != "assistant" for m in new):
            before = [render_message(m) for m in previous.messages]
            after = [render_message(m) for m in new]
            seen = fmt.decode(previous.context_ids) + (fmt.end_text if previous.open else "")
            text, rewrite = fmt.delta_text(before, after, list(tools), seen)
            delta = fmt.encode(text)
            if previous.open:
                delta = np.concatenate([[fmt.end_id], delta])
            ids = np.concatenate([previous.context_ids, delta]).astype(np.int64)
            return Prompt(ids, True, rewrite)
    return Prompt(render_ids(fmt, messages, tools), False)


def _same(kept: Sequence[dict], sent: Sequence[dict]) -> bool:
    """The messages match, an assistant's ``reasoning_content`` and call ids aside when the
    client dropped them (the reasoning is in the context ids; the ids are ours)."""
    if len(kept) != len(sent):
        return False
    for a, b in zip(kept, sent):
        a = {k: v for k, v in a.items()
             if k != "tool_call_ids" and (k != "reasoning_content" or k in b)}
        if a != {k: v for k, v in b.items() if k != "tool_call_ids"}:
            return False
    return True
