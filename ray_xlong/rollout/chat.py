"""Chat formats: how a harness turns environment text into context ids and model ids into actions.

A format (:class:`ChatFormat`) starts one :class:`Conversation` per agent; the harness drives it::

    conv = fmt.start(system, user, tools=schemas)    conv.prompt_ids: the first context
    loop:  ctx += conv.delta()                        pending environment messages (+ the
                                                      generation prompt), as an id *delta*
           out = engine.generate(ctx)                 the model's ids, appended as sampled
           action = conv.parse(out)                   ToolCalls | Answer | Malformed
           conv.add_output(out, action)               remembered as the assistant turn
           conv.add_tool_results([text, ...], ...)    one result per call, in order
    compaction: ctx += conv.delta(summarize=True) → summary ids → conv.compacted(summary)

Two formats:

* ``token`` (``token_format.py``, :class:`TokenFormat`): the tiny demo model's own special
  tokens (``[call] name args [end]``), one tool call a turn, positional arguments mapped onto the
  tool's schema.
* ``template`` (``template_format.py``, :class:`TemplateFormat`): any HF tokenizer with a
  ``chat_template``; tool calls in the model's convention, parsed by vLLM's tool parsers
  (``tool_calls.py``: ``hermes``, ``llama3_json``, ``mistral``, ``granite``, ``deepseek_v31``,
  ``qwen3_coder``), reasoning split off by vLLM's reasoning parsers (``reasoning.py``).
  Token-exact by construction: model ids are never re-encoded; only environment messages are
  rendered, as the delta the template adds to the conversation; where a template rewrites
  history the context keeps what the model saw and ``Conversation.rewrites`` counts it.

``formats.load_chat_format`` picks the format of a model directory (``formats.py``: this module
holds the records and protocols every format builds on, and imports none of them).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol, Sequence

import numpy as np


@dataclasses.dataclass(frozen=True, slots=True)
class ToolCall:
    """One tool call of a model turn."""

    name: str
    """Tool name."""
    arguments: Any
    """Parsed arguments (a dict when well formed; the harness checks them against the schema)."""


@dataclasses.dataclass(frozen=True, slots=True)
class ToolCalls:
    """The model called one or more tools (executed and answered in order)."""

    calls: tuple[ToolCall, ...]
    """The calls, in the order the model wrote them."""
    content: str = ""
    """Text before the calls (may be empty)."""
    reasoning: str = ""
    """The turn's reasoning (``reasoning.py``; empty for models without)."""
    ids: tuple[str, ...] = dataclasses.field(default=(), compare=False)
    """Call ids the model wrote (Mistral's 9-character ids), one per call; empty: none."""


@dataclasses.dataclass(frozen=True, slots=True)
class Answer:
    """The model gave its final answer."""

    text: str
    """The answer text (stripped; reasoning excluded)."""
    reasoning: str = ""
    """The turn's reasoning (``reasoning.py``; empty for models without)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Malformed:
    """The output does not follow the format."""

    reason: str
    """Why (for logs and the error message shown to the model)."""


Action = ToolCalls | Answer | Malformed


class ChatFormatError(ValueError):
    """A model directory / tokenizer cannot be used with the requested chat format."""


class Conversation(Protocol):
    """One agent's conversation (see module docstring)."""

    prompt_ids: np.ndarray
    """The first context: system + user (+ tools), ending with the generation prompt."""
    rewrites: int
    """Deltas computed while the template rewrote earlier turns (0 for append-only templates)."""

    def parse(self, output_ids: np.ndarray) -> Action:
        """Classify a model output."""

    def add_output(self, output_ids: np.ndarray, action: Action) -> None:
        """The output was appended to the context: remember it as the assistant turn."""

    def add_tool_results(self, texts: Sequence[str], *, max_tokens: int) -> int:
        """Queue one tool message per text (each cut to ``max_tokens``); returns how many
        were cut."""

    def delta(self, *, summarize: bool = False, commit: bool = True) -> np.ndarray:
        """Ids the environment appends before the next model call: the queued messages
        (+ the summary request) + the generation prompt; empty when nothing is queued."""

    def compacted(self, summary_ids: np.ndarray) -> tuple[np.ndarray, "Conversation"]:
        """A fresh context (prompt + the summary ids as generated + a continue turn) and its
        conversation."""


class ChatFormat(Protocol):
    """A chat format (see module docstring)."""

    stop_token_ids: tuple[int, ...]
    """Ids that end a model turn (kept in the output)."""

    def start(self, system: str, user: str, *, tools: Sequence[dict]) -> Conversation:
        """A new conversation with OpenAI function schemas ``tools``."""

    def turn_ids(self, *, calls: Sequence[ToolCall] = (), text: str = "") -> np.ndarray:
        """The ids a model following the format emits for a turn (demonstrations, scripts)."""

    def encode(self, text: str) -> np.ndarray:
        """Environment text → ids."""

    def decode(self, ids: np.ndarray) -> str:
        """Ids → text (display and parsing only)."""


def demonstration_ids(fmt: ChatFormat, *, system: str, user: str, tools: Sequence[dict],
                      turns: Sequence[tuple[Sequence[ToolCall], str, Sequence[str]]]
                      ) -> tuple[np.ndarray, np.ndarray]:
    """A whole run as ``(ids [n], loss_mask [n] bool)`` (mask = the model's turns).

    Args:
        fmt: the chat format.
        system, user, tools: the run's start.
        turns: ``(calls, text, tool result texts)`` per model turn (no calls: an answer).
    """
    conv = fmt.start(system, user, tools=tools)
    parts = [(conv.prompt_ids, False)]
    for calls, text, results in turns:
        delta = conv.delta()
        if delta.size:
            parts.append((delta, False))
        out = fmt.turn_ids(calls=calls, text=text)
        conv.add_output(out, ToolCalls(tuple(calls), text) if calls else Answer(text))
        parts.append((out, True))
        if results:
            conv.add_tool_results(results, max_tokens=1 << 20)
    ids = np.concatenate([p for p, _ in parts]).astype(np.int64)
    mask = np.concatenate([np.full(p.size, m) for p, m in parts])
    return ids, mask
