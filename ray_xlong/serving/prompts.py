"""Token-exact prompts for an external agent's chat requests.

An agent's context is a buffer of ids, as in the harness. A request *extends* the agent's
previous request when its messages are the previous messages + the assistant message as it was
returned + new messages (tools unchanged). Then, and only then::

    prompt = previous prompt ids ++ previous output ids (exactly as sampled)
             ++ encode(delta of the new messages)          (template_delta.take_delta: what the
                                                            template appends to what the model saw)

so no history is re-rendered and no model output re-tokenized, and the run's calls chain into
one trajectory. The delta is rendered from a window (the head and the last turns, proven per
template; ``rollout/template_delta.py``) and the context keeps what the model saw in chunks, so
a request's cost on the endpoint does not grow with the history beyond comparing the messages
sent (:func:`normalize_request`: the previous request's messages compared as sent, only the new
ones normalized). Anything else (an edited or compacted history, other tools, a first request)
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
from ray_xlong.rollout.template_delta import Seen, take_delta
from ray_xlong.rollout.template_format import TemplateFormat
from ray_xlong.serving.messages import normalize, render_message
from ray_xlong.trajectory.records import append_only


class IdBuffer:
    """The ids of an agent's successive contexts in one growing array (doubling), so a request
    appends its delta and output in place instead of copying the whole context.

    Contexts are read-only views ``buf[:n]``; an extension of the view ending at the buffer's
    end writes after it, any other (a branch: two requests extending one context) copies, so
    no view's ids ever change."""

    __slots__ = ("buf", "end")

    def __init__(self, ids: np.ndarray) -> None:
        self.buf = np.empty(max(1024, 2 * len(ids)), np.int64)
        self.buf[:len(ids)] = ids
        self.end = len(ids)
        append_only(self.buf)

    def view(self) -> np.ndarray:
        out = self.buf[:self.end]
        out.flags.writeable = False
        return out

    def extended(self, n: int, new: np.ndarray) -> "IdBuffer":
        """The buffer holding ``buf[:n] ++ new`` (this one when ``n`` is its end)."""
        if n != self.end:
            return IdBuffer(np.concatenate([self.buf[:n], new]))
        if self.end + len(new) > len(self.buf):
            grown = np.empty(max(2 * len(self.buf), self.end + len(new)), np.int64)
            grown[:self.end] = self.buf[:self.end]
            append_only(grown, grown_from=self.buf)
            self.buf = grown                  # old views keep the old array (never written)
        self.buf[self.end:self.end + len(new)] = new
        self.end += len(new)
        return self


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
    rendered: tuple[dict, ...] = ()
    """``messages`` as the chat template takes them (``render_message``); () : not kept."""
    seen: Seen | None = None
    """What the model saw (None: decoded from ``context_ids`` when needed)."""
    raw: tuple = ()
    """The request's messages as sent (the next request's are compared with them first)."""
    buffer: IdBuffer | None = None
    """The array ``context_ids`` views (extended in place by the next request)."""


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class Prompt:
    """The ids of one chat request."""

    ids: np.ndarray
    """``[n]`` the ids sent to the engine."""
    extends: bool
    """True: previous context ++ delta; False: rendered afresh."""
    rewrite: bool = False
    """The delta was taken while the template rewrote history."""
    seen: Seen | None = None
    """What the model saw, through these ids."""
    rendered: tuple[dict, ...] = ()
    """The request's messages as the chat template takes them."""
    buffer: IdBuffer | None = None
    """The array ``ids`` views."""


def render_text(fmt: TemplateFormat, messages: Sequence[dict], tools: Sequence[dict]) -> str:
    """The whole conversation rendered by the chat template (+ the generation prompt)."""
    try:
        return fmt.tokenizer.apply_chat_template(list(messages), tools=list(tools) or None,
                                                 tokenize=False, add_generation_prompt=True)
    except Exception as exc:  # noqa: BLE001 - the request's fault: name it
        raise ChatFormatError(f"messages: the chat template failed to render them: {exc}") \
            from exc


def render_ids(fmt: TemplateFormat, messages: Sequence[dict], tools: Sequence[dict]
               ) -> np.ndarray:
    """The whole conversation rendered by the chat template (+ the generation prompt)."""
    return fmt.encode(render_text(fmt, [render_message(m) for m in messages], tools))


def normalize_request(raw: Sequence, previous: AgentContext | None) -> list[dict]:
    """The request's messages in normal form; where they start with the previous request's
    messages as sent, those are taken from ``previous`` and only the rest normalized."""
    k = len(previous.raw) if previous is not None else 0
    if k and len(raw) > k and list(raw[:k]) == list(previous.raw):
        return list(previous.messages[:k]) + normalize(raw[k:], start=k)
    return normalize(raw)


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
            before = previous.rendered or tuple(render_message(m) for m in previous.messages)
            after = tuple(render_message(m) for m in new)
            seen = previous.seen or _decoded(fmt, previous, before, tools)
            delta = take_delta(fmt, before, after, list(tools), seen, open=previous.open)
            ids = fmt.encode(delta.text)
            if previous.open:
                ids = np.concatenate([[fmt.end_id], ids])
            n = len(previous.context_ids)
            buffer = previous.buffer.extended(n, ids) if previous.buffer is not None \
                else IdBuffer(np.concatenate([previous.context_ids, ids]))
            return Prompt(buffer.view(), True, delta.rewrite, delta.seen, before + after,
                          buffer)
    rendered = tuple(render_message(m) for m in messages)
    text = render_text(fmt, rendered, tools)
    head = next((i for i, m in enumerate(rendered) if m["role"] == "assistant"), len(rendered))
    head_text = text if head == len(rendered) else render_text(fmt, rendered[:head], tools)
    return Prompt(fmt.encode(text), False, seen=Seen(head, head_text, (text,)),
                  rendered=rendered)


def next_context(fmt: TemplateFormat, prompt: Prompt, messages: Sequence[dict], turn: dict,
                 tools: tuple, output_ids: np.ndarray, raw: Sequence) -> AgentContext:
    """What the endpoint keeps of a request answered with ``turn`` (normal form) sampled as
    ``output_ids``."""
    out = np.asarray(output_ids, np.int64)
    seen = prompt.seen.with_output(fmt.decode(out), len(messages)) if prompt.seen else None
    buffer = prompt.buffer.extended(len(prompt.ids), out) if prompt.buffer is not None \
        else IdBuffer(np.concatenate([prompt.ids, out]))
    return AgentContext(tuple(messages) + (turn,), tools, buffer.view(),
                        not (out.size and int(out[-1]) in fmt.stop_token_ids),
                        prompt.rendered + (render_message(turn),), seen, tuple(raw), buffer)


def _decoded(fmt: TemplateFormat, previous: AgentContext, rendered: Sequence[dict],
             tools: Sequence[dict]) -> Seen:
    """What the model saw, for a context kept without it: its ids decoded, one chunk."""
    head = next((i for i, m in enumerate(rendered) if m["role"] == "assistant"),
                len(rendered))
    return Seen(head, render_text(fmt, rendered[:head], tools),
                (fmt.decode(previous.context_ids),))


def _same(kept: Sequence[dict], sent: Sequence[dict]) -> bool:
    """The messages match, an assistant's ``reasoning_content`` and call ids aside when the
    client dropped them (the reasoning is in the context ids; the ids are ours)."""
    if len(kept) != len(sent):
        return False
    if list(kept) == list(sent):
        return True
    for a, b in zip(kept, sent):
        a = {k: v for k, v in a.items()
             if k != "tool_call_ids" and (k != "reasoning_content" or k in b)}
        if a != {k: v for k, v in b.items() if k != "tool_call_ids"}:
            return False
    return True
