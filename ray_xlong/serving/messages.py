"""OpenAI chat messages as the endpoint compares and renders them, and the agent header.

An agent sends back, in its next request, the assistant message it was given (ids and all, or
re-serialized by its client). The endpoint decides whether the new request *extends* the
agent's previous one by comparing messages in a normal form that keeps what the chat template
renders and drops what it does not::

    {"role": "assistant", "content": null, "tool_calls": [{"id": "call_1", "type": "function",
     "function": {"name": "lookup", "arguments": "{\\"key\\": 3}"}}]}
        -> {"role": "assistant", "content": "", "tool_calls": [("lookup", {"key": 3})]}

(content parts joined to text, ``null`` content as ``""``, tool-call arguments parsed from their
JSON string; call ids kept aside as ``tool_call_ids`` / ``tool_call_id``, which templates such
as Mistral's render but the comparison ignores; an assistant's ``reasoning_content`` kept).
:func:`render_message` gives the form a HF chat template takes (arguments as a dict). :func:`parse_agent_header` reads ``X-Xlong-Agent``.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Iterable

from ray_xlong.trajectory.records import CALL_KINDS

AGENT_HEADER = "x-xlong-agent"
"""``X-Xlong-Agent: <agent_id>[;kind=main|summary|subagent][;parent=<agent_id>]``."""


class MessageError(ValueError):
    """A message or header the endpoint cannot use (the text names the field)."""


@dataclasses.dataclass(frozen=True, slots=True)
class AgentTag:
    """Who made a request (from ``X-Xlong-Agent``)."""

    agent_id: str
    """The agent (default ``main``)."""
    kind: str = "main"
    """``main`` | ``summary`` | ``subagent``."""
    parent: str | None = None
    """The agent that spawned this one (required for ``subagent``)."""


def parse_agent_header(value: str | None) -> AgentTag:
    """``X-Xlong-Agent`` → :class:`AgentTag`; raises :class:`MessageError` naming the part."""
    if value is None or not value.strip():
        return AgentTag("main")
    head, *parts = [p.strip() for p in value.split(";")]
    if not head or "=" in head:
        raise MessageError(f"X-Xlong-Agent: the first part must be the agent id, got {value!r}")
    fields: dict[str, str] = {}
    for part in parts:
        key, sep, val = part.partition("=")
        if not sep or key not in ("kind", "parent") or not val:
            raise MessageError(f"X-Xlong-Agent: {part!r} is not kind=<kind> or parent=<agent>")
        fields[key] = val
    kind = fields.get("kind", "main")
    if kind not in CALL_KINDS:
        raise MessageError(f"X-Xlong-Agent: kind {kind!r} is not one of {CALL_KINDS}")
    parent = fields.get("parent")
    if kind == "subagent" and parent is None:
        raise MessageError("X-Xlong-Agent: kind=subagent needs parent=<agent_id>")
    if parent == head:
        raise MessageError(f"X-Xlong-Agent: agent {head!r} cannot be its own parent")
    return AgentTag(head, kind, parent)


def _text(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                raise MessageError(f"{where}.content: only text parts are supported, got "
                                   f"{part!r:.60}")
            parts.append(str(part.get("text", "")))
        return "".join(parts)
    raise MessageError(f"{where}.content must be a string or a list of text parts")


def _arguments(raw: Any, where: str) -> Any:
    if isinstance(raw, str):
        try:
            return json.loads(raw) if raw.strip() else {}
        except ValueError as exc:
            raise MessageError(f"{where}.function.arguments is not valid JSON: {exc}") from None
    return raw


def normalize(messages: Iterable[Any], *, start: int = 0) -> list[dict]:
    """Messages in the normal form described in the module docstring (``start``: the index of
    the first, for error messages)."""
    out = []
    for i, msg in enumerate(messages, start):
        where = f"messages[{i}]"
        if not isinstance(msg, dict) or not isinstance(msg.get("role"), str):
            raise MessageError(f"{where}: a message is an object with a role")
        role = msg["role"]
        norm: dict = {"role": role, "content": _text(msg.get("content"), where)}
        if role == "assistant" and msg.get("tool_calls"):
            calls = []
            for j, call in enumerate(msg["tool_calls"]):
                fn = call.get("function") if isinstance(call, dict) else None
                if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                    raise MessageError(f"{where}.tool_calls[{j}]: needs function.name")
                calls.append((fn["name"], _arguments(fn.get("arguments"),
                                                     f"{where}.tool_calls[{j}]")))
            norm["tool_calls"] = calls
            ids = [c.get("id") for c in msg["tool_calls"] if isinstance(c, dict)]
            if ids and all(isinstance(i, str) and i for i in ids):
                norm["tool_call_ids"] = ids
        if role == "tool" and isinstance(msg.get("tool_call_id"), str):
            norm["tool_call_id"] = msg["tool_call_id"]
        reasoning = msg.get("reasoning_content", msg.get("reasoning")) \
            if role == "assistant" else None
        if isinstance(reasoning, str) and reasoning:
            norm["reasoning_content"] = reasoning
        out.append(norm)
    return out


def render_message(norm: dict) -> dict:
    """A normal-form message as a chat template takes it (tool-call arguments as objects)."""
    msg: dict = {"role": norm["role"], "content": norm["content"]}
    if norm.get("tool_calls"):                  # content stays a string: templates such as
        ids = norm.get("tool_call_ids") or []   # Qwen3's call .lstrip() on it
        msg["tool_calls"] = [{"type": "function", "function": {"name": n, "arguments": a},
                              **({"id": ids[i]} if i < len(ids) else {})}
                             for i, (n, a) in enumerate(norm["tool_calls"])]
    if norm.get("tool_call_id"):                # Mistral's templates require the ids
        msg["tool_call_id"] = norm["tool_call_id"]
    if norm.get("reasoning_content"):
        msg["reasoning_content"] = norm["reasoning_content"]
    return msg
