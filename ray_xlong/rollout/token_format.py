"""The token format of the tiny demo model: prompts, calls and results in its own special tokens.

For the locally built tokenizer of ``models/tokenizer.py`` (12 specials at ids 0-11), not for
a user's model (that is the template format, ``template_format.py``).

One run's context, as ids (``[x]`` is a special token of ``models/tokenizer.py``)::

    [bos] [system] system text [end] [user] task text [end] [assistant]
        model:  [call] add 3 4 [end]                       a tool call (name, then arguments)
    [tool] 7 [end] [assistant]                             the tool's result (context)
        model:  [answer] 7 [end]                           the final answer

    summary call:  <context> [summarize]  ->  model: summary text [end]
    after compaction: [bos] [system] .. [end] [user] .. [end] [summary] <summary ids> [end] [assistant]

Environment text (system, task, tool results) is tokenized here; model output never is: a
summary re-enters the context as the exact ids the model generated, and outputs are only
*decoded* to be parsed into an :class:`Action`.

Parsing (``parse``): an output is well formed iff it ends with ``[end]``, starts with ``[call]``
or ``[answer]`` and holds no other special token; a call names a tool (first word of its text,
the rest are its arguments). Anything else is :class:`Malformed`, with the reason. One call a
turn; its words map onto the tool schema's properties in order (the last property takes the
rest of the text; ``integer`` / ``number`` properties are converted when they parse), so
``[call] add 3 4 [end]`` is ``add({"a": 3, "b": 4})``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import numpy as np

from ray_xlong.models.tokenizer import SPECIAL_TOKENS
from ray_xlong.rollout.chat import Action, Answer, ChatFormatError, Malformed, ToolCall, ToolCalls

_ID = {name.strip("<|>"): i for i, name in enumerate(SPECIAL_TOKENS)}


@dataclasses.dataclass(frozen=True, slots=True)
class RawCall:
    """A call as written in the token format."""

    name: str
    """Tool name (first word of the call text)."""
    args: str
    """Everything after the name (leading whitespace stripped once)."""


class TokenFormat:
    """Builds context ids and parses outputs with a tokenizer from ``ray_xlong.models``."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        for name, i in _ID.items():
            if tokenizer.convert_tokens_to_ids(f"<|{name}|>") != i:
                raise ChatFormatError(f"token format: the tokenizer's special token <|{name}|> "
                                      f"must have id {i} (a tokenizer of models/tokenizer.py)")
        self.end = _ID["end"]
        self.call = _ID["call"]
        self.answer = _ID["answer"]
        self.summarize = _ID["summarize"]
        self.stop_token_ids: tuple[int, ...] = (self.end,)

    def encode(self, text: str) -> np.ndarray:
        """Environment text → ids (special-token strings in ``text`` are not special)."""
        ids = self.tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True)
        return np.asarray(ids, np.int64)

    def decode(self, ids: np.ndarray) -> str:
        """Ids → text (for parsing and display only)."""
        return self.tokenizer.decode([int(t) for t in ids], skip_special_tokens=False)

    def prompt(self, system: str, user: str) -> np.ndarray:
        """``[bos] [system] system [end] [user] user [end] [assistant]``."""
        return np.concatenate([[_ID["bos"], _ID["system"]], self.encode(system),
                               [self.end, _ID["user"]], self.encode(user),
                               [self.end, _ID["assistant"]]]).astype(np.int64)

    def tool_result(self, text: str, *, max_tokens: int) -> np.ndarray:
        """``[tool] text [end] [assistant]``; text cut to ``max_tokens`` ids (marked)."""
        return self.wrap_tool_result(self.cut_tool_text(text, max_tokens=max_tokens)[0])

    def cut_tool_text(self, text: str, *, max_tokens: int) -> tuple[np.ndarray, bool]:
        """Tool output text → at most ``max_tokens`` ids, plus `` [truncated]`` when it was cut.

        Only the first ``16 * max_tokens`` characters are tokenized (a flood of megabytes costs
        no more than a short output); a cut there is marked too. Lone surrogates (not UTF-8)
        become ``?`` instead of failing the tokenizer.

        Returns:
            ``(ids [<= max_tokens + marker], truncated)``.
        """
        limit = max_tokens * 16
        head = text[:limit].encode("utf-8", "replace").decode("utf-8")
        ids = self.encode(head)
        truncated = len(text) > limit or ids.size > max_tokens
        if truncated:
            ids = np.concatenate([ids[:max_tokens], self.encode(" [truncated]")])
        return ids.astype(np.int64, copy=False), truncated

    def wrap_tool_result(self, ids: np.ndarray) -> np.ndarray:
        """``[tool] ids [end] [assistant]``."""
        return np.concatenate([[_ID["tool"]], ids, [self.end, _ID["assistant"]]]).astype(np.int64)

    def compacted(self, prompt_ids: np.ndarray, summary_ids: np.ndarray) -> np.ndarray:
        """A fresh context: the prompt, then ``[summary] <summary ids> [end] [assistant]``.

        ``prompt_ids`` ends with ``[assistant]``, which is dropped before the summary."""
        body = summary_ids[:-1] if summary_ids.size and summary_ids[-1] == self.end \
            else summary_ids
        return np.concatenate([prompt_ids[:-1], [_ID["summary"]], body,
                               [self.end, _ID["assistant"]]]).astype(np.int64)

    def start(self, system: str, user: str, *, tools: Sequence[dict]) -> "TokenConversation":
        """A new conversation (``tools``: OpenAI function schemas, for argument mapping)."""
        return TokenConversation(self, self.prompt(system, user), tools)

    def turn_ids(self, *, calls: Sequence[ToolCall] = (), text: str = "") -> np.ndarray:
        """``[call] name v1 v2 [end]`` (one call) or ``[answer] text [end]``."""
        if len(calls) > 1:
            raise ChatFormatError("token format: one tool call a turn")
        if not calls:
            return self.answer_ids(text)
        args = calls[0].arguments if isinstance(calls[0].arguments, dict) else {}
        return self.call_ids(calls[0].name, " ".join(str(v) for v in args.values()))

    def parse(self, output_ids: np.ndarray) -> RawCall | Answer | Malformed:
        """Classify a model output (see module docstring)."""
        ids = [int(t) for t in output_ids]
        if not ids or ids[-1] != self.end:
            return Malformed("output does not end with <|end|>")
        head, body = ids[0], ids[1:-1]
        if head not in (self.call, self.answer):
            return Malformed("output must start with <|call|> or <|answer|>")
        if any(t < len(SPECIAL_TOKENS) for t in body):
            return Malformed("special token inside the output")
        text = self.decode(np.asarray(body))
        if head == self.answer:
            return Answer(text.strip())
        parts = text.strip().split(None, 1)
        if not parts:
            return Malformed("tool call names no tool")
        return RawCall(parts[0], parts[1] if len(parts) > 1 else "")

    def call_ids(self, name: str, args: str = "") -> np.ndarray:
        """The ids of a well-formed tool call (demonstrations, scripted policies)."""
        text = f"{name} {args}" if args else name
        return np.concatenate([[self.call], self.encode(text), [self.end]]).astype(np.int64)

    def answer_ids(self, text: str) -> np.ndarray:
        """The ids of a well-formed answer."""
        return np.concatenate([[self.answer], self.encode(text), [self.end]]).astype(np.int64)


def positional_arguments(args: str, tool: dict | None) -> dict[str, Any]:
    """Map a call's words onto ``tool``'s schema properties in order (module docstring)."""
    props = list((((tool or {}).get("function") or {}).get("parameters") or {})
                 .get("properties", {}).items())
    if not props:
        return {"args": args} if args.strip() else {}
    words = args.strip().split(None, len(props) - 1) if args.strip() else []
    out: dict[str, Any] = {}
    for (name, schema), word in zip(props, words):
        kind = schema.get("type") if isinstance(schema, dict) else None
        try:
            out[name] = int(word) if kind == "integer" else float(word) if kind == "number" \
                else word
        except ValueError:
            out[name] = word                   # the schema check reports it
    return out


class TokenConversation:
    """One agent's conversation in the token format (``chat.Conversation``)."""

    def __init__(self, fmt: TokenFormat, prompt_ids: np.ndarray, tools: Sequence[dict]) -> None:
        self.fmt, self.prompt_ids, self.rewrites = fmt, prompt_ids, 0
        self.tools = {t["function"]["name"]: t for t in tools}
        self._pending: list[np.ndarray] = []

    def parse(self, output_ids: np.ndarray) -> Action:
        raw = self.fmt.parse(output_ids)
        if not isinstance(raw, RawCall):
            return raw
        call = ToolCall(raw.name, positional_arguments(raw.args, self.tools.get(raw.name)))
        return ToolCalls((call,), "")

    def add_output(self, output_ids: np.ndarray, action: Action) -> None:
        pass                                     # the ids are the context; nothing to render

    def add_tool_results(self, texts: Sequence[str], *, max_tokens: int) -> int:
        cut = 0
        for text in texts:
            ids, truncated = self.fmt.cut_tool_text(text, max_tokens=max_tokens)
            self._pending.append(self.fmt.wrap_tool_result(ids))
            cut += int(truncated)
        return cut

    def delta(self, *, summarize: bool = False, commit: bool = True) -> np.ndarray:
        parts = list(self._pending) + ([np.array([self.fmt.summarize])] if summarize else [])
        if commit:
            self._pending = []
        return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)

    def compacted(self, summary_ids: np.ndarray) -> tuple[np.ndarray, "TokenConversation"]:
        fresh = self.fmt.compacted(self.prompt_ids, np.asarray(summary_ids))
        return fresh, TokenConversation(self.fmt, self.prompt_ids, list(self.tools.values()))
