"""The delta of a model call rendered from a fixed window, not the whole history: O(new tokens).

The exact rule (``TemplateFormat.delta_text``) renders the whole conversation each call and
takes what follows the text the model saw. Its cost grows with the history (O(n²) per run).
The windowed rule renders only the conversation's *head* (the messages before the first
assistant turn: system prompt, task, tools) and the last ``window`` assistant turns with what
follows them, and checks it against the model-seen text of the same span::

    messages  = [sys, user] a1 t1 a2 t2 … a(k-1) t(k-1) a(k)  + new (tool results, user turns)
    window    = [sys, user]                 a(k-1) t(k-1) a(k) + new
    seen      = head text ++ chunks of outputs and deltas: |prompt|a1|d1|a2|d2|…|a(k-1)|d(k-1)|a(k)|
    window seen = head text ++                                         |a(k-1)|d(k-1)|a(k)|
    T = render(window + new, gen)   T starts with window seen → delta = the rest (append-only)
                                    else → the template rewrote: what it renders after the last
                                    assistant turn (delta_after_last_turn on the window), counted

Once a conversation diverged from the template (a rewrite), every later call is a rewrite, as
under the exact rule (the template's render of the history never again starts with what the
model saw). The windowed rule equals the exact rule for templates whose render of the appended
messages depends only on the window ("local" templates: every family in tests/data/templates).
Where that holds is checked, never assumed:

- **a per-template proof, computed once** per (format, tools): a probe conversation (tool
  rounds, two calls in a turn, reasoning, a cut-off turn, a summary request) is driven with both
  rules at every call; a *kind* of call (the roles of the new messages, cut off or not) is proven
  when both agree on every call of that kind. A kind not proven takes the exact rule (the slow
  path, counted ``unproven``);
- **the first calls** of every conversation (``DeltaChecks.first`` windowed calls) and, if asked,
  **every N-th call** (``DeltaChecks.every``) also take the exact rule and compare: a mismatch
  keeps the exact result, is counted (``mismatches``) and revokes the kind for the format.

Counters live on the format (:class:`DeltaStats`). Calls whose window is the whole conversation
(the first two turns) take the exact rule directly: it costs the same there.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Sequence

from ray_xlong.rollout.chat import ChatFormatError, Malformed, ToolCall


@dataclasses.dataclass(frozen=True, slots=True)
class DeltaChecks:
    """How a template format renders deltas; validated at construction."""

    windowed: bool = True
    """Render deltas from the window (False: every call renders the whole conversation, the
    exact rule)."""
    window: int = 2
    """Assistant turns kept in the window (>= 1)."""
    first: int = 2
    """Windowed calls of each conversation also checked against the exact rule (>= 0)."""
    every: int = 0
    """Then every ``every``-th windowed call checked too (0: never; the proof stands)."""

    def __post_init__(self) -> None:
        for name, low in (("window", 1), ("first", 0), ("every", 0)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"DeltaChecks.{name} must be an int >= {low}, got {value!r}")
        if not isinstance(self.windowed, bool):
            raise ValueError(f"DeltaChecks.windowed must be a bool, got {self.windowed!r}")


@dataclasses.dataclass(slots=True)
class DeltaStats:
    """Counters of one format's deltas (mutable; read them as ``fmt.delta_stats``)."""

    windowed: int = 0
    """Deltas rendered from the window."""
    exact: int = 0
    """Deltas rendered from the whole conversation (short conversations, checks, slow path)."""
    checked: int = 0
    """Windowed deltas also computed by the exact rule and compared."""
    mismatches: int = 0
    """Checks where the window disagreed (the exact result kept; the kind revoked)."""
    unproven: int = 0
    """Calls of a kind the format's proof did not cover or failed (the slow exact path)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Seen:
    """The text a conversation's model saw, in chunks, and where each output began.

    Immutable: an extension returns a new ``Seen`` (the chunk tuple is copied, never the text),
    so a context may be extended twice (the endpoint's retried requests)."""

    head: int
    """Messages before the first assistant turn (system prompt, task)."""
    head_text: str
    """``render(messages[:head], gen=True)``: what opens the window."""
    chunks: tuple[str, ...]
    """The seen text: the prompt, then each output and delta as appended."""
    turns: tuple[tuple[int, int], ...] = ()
    """Per output: (its assistant message's index, its chunk's index)."""
    diverged: bool = False
    """The template rewrote what the model saw (every later delta is a rewrite)."""
    calls: int = 0
    """Windowed deltas taken so far."""

    def text(self) -> str:
        """The whole seen text (O(n): the exact rule's input)."""
        return "".join(self.chunks)

    def with_output(self, text: str, message_index: int) -> "Seen":
        """After the model's output (``text`` decoded) became message ``message_index``."""
        return dataclasses.replace(self, chunks=self.chunks + (text,),
                                   turns=self.turns + ((message_index, len(self.chunks)),))

    def with_delta(self, text: str, *, end: str, rewrite: bool, windowed: bool) -> "Seen":
        """After a delta (``end``: the end-of-turn text the environment added before it to a
        cut-off turn, else "")."""
        return dataclasses.replace(self, chunks=self.chunks + ((end, text) if end else (text,)),
                                   diverged=self.diverged or rewrite,
                                   calls=self.calls + int(windowed))


@dataclasses.dataclass(frozen=True, slots=True)
class Delta:
    """One call's delta."""

    text: str
    """What the template appends (the end-of-turn text of a cut-off turn not included)."""
    rewrite: bool
    """The template rewrote what the model saw (counted by the caller)."""
    seen: Seen
    """The seen text after it."""


def kind_of(new: Sequence[dict], open: bool) -> tuple:
    """A call's kind: the roles of its new messages, and whether the last turn was cut off."""
    return tuple(sorted({m.get("role", "") for m in new})), bool(open)


def take_delta(fmt: Any, messages: Sequence[dict], new: Sequence[dict], tools: Sequence[dict],
               seen: Seen, *, open: bool, probe: dict | None = None) -> Delta:
    """The delta of ``new`` after ``messages`` (see module docstring).

    Args:
        fmt: the template format (``delta_checks``, ``delta_stats``, its renderer).
        messages: the conversation so far, its last message the model's last output.
        new: the environment's new messages.
        tools: the conversation's tools.
        seen: what the model saw (``seen.turns[-1]`` is the last message's output).
        open: the last output was cut off (the end-of-turn text is added before the delta).
        probe: the proof's record (kind → agreed so far): both rules run, the exact one kept.
    """
    checks, stats = fmt.delta_checks, fmt.delta_stats
    end = fmt.end_text if open else ""
    win = _window(messages, seen, checks.window, end)
    if probe is None and (not checks.windowed or win is None):
        return _exact(fmt, messages, new, tools, seen, open, counted=True)
    kind = kind_of(new, open)
    if probe is not None:
        ref = _exact(fmt, messages, new, tools, seen, open, counted=False)
        if win is not None:
            try:
                agree = _windowed(fmt, win, new, tools) == (ref.text, ref.rewrite)
            except ChatFormatError:
                agree = False
            probe[kind] = probe.get(kind, True) and agree
        return ref
    if not _proven(fmt, tools, kind):
        stats.unproven += 1
        return _exact(fmt, messages, new, tools, seen, open, counted=True)
    n = seen.calls + 1
    check = n <= checks.first or (checks.every > 0 and n % checks.every == 0)
    try:
        text, rewrite = _windowed(fmt, win, new, tools)
    except ChatFormatError:
        stats.unproven += 1
        return _exact(fmt, messages, new, tools, seen, open, counted=True)
    stats.windowed += 1
    if check:
        stats.checked += 1
        ref = _exact(fmt, messages, new, tools, seen, open, counted=False)
        if (ref.text, ref.rewrite) != (text, rewrite):
            stats.mismatches += 1
            fmt._delta_proofs.setdefault(_tools_key(tools), {})[kind] = False
            return dataclasses.replace(ref, seen=dataclasses.replace(ref.seen, calls=n))
    return Delta(text, rewrite, seen.with_delta(text, end=end, rewrite=rewrite, windowed=True))


def _exact(fmt: Any, messages: Sequence[dict], new: Sequence[dict], tools: Sequence[dict],
           seen: Seen, open: bool, *, counted: bool) -> Delta:
    """The exact rule: the whole conversation rendered (``TemplateFormat.delta_text``)."""
    end = fmt.end_text if open else ""
    text, rewrite = fmt.delta_text(list(messages), list(new), tools, seen.text() + end)
    fmt.delta_stats.exact += int(counted)
    return Delta(text, rewrite, seen.with_delta(text, end=end, rewrite=rewrite, windowed=False))


def _window(messages: Sequence[dict], seen: Seen, turns: int, end: str
            ) -> tuple[list[dict], str, bool] | None:
    """(window messages, the model-seen text of the window, diverged), or None when the window
    would be the whole conversation (or the outputs' places are unknown)."""
    if not seen.turns or seen.turns[-1][0] != len(messages) - 1:
        return None
    first, chunk = seen.turns[-min(turns, len(seen.turns))]
    if first <= seen.head:
        return None
    window = list(messages[:seen.head]) + list(messages[first:])
    return window, seen.head_text + "".join(seen.chunks[chunk:]) + end, seen.diverged


def _windowed(fmt: Any, win: tuple[list[dict], str, bool], new: Sequence[dict],
              tools: Sequence[dict]) -> tuple[str, bool]:
    """The windowed rule: (delta text, rewrite)."""
    window, window_seen, diverged = win
    if not diverged:
        text = fmt._render(window + list(new), tools, True)
        if text.startswith(window_seen):
            return text[len(window_seen):], False
    return fmt.delta_after_last_turn(window, list(new), tools), True


def _tools_key(tools: Sequence[dict]) -> str:
    return json.dumps(list(tools), sort_keys=True, default=str)


def _proven(fmt: Any, tools: Sequence[dict], kind: tuple) -> bool:
    """Whether the format's proof (computed once per tools) covers ``kind``."""
    key = _tools_key(tools)
    proof = fmt._delta_proofs.get(key)
    if proof is None:
        proof = fmt._delta_proofs[key] = prove(fmt, tools)
    return bool(proof.get(kind, False))


def prove(fmt: Any, tools: Sequence[dict]) -> dict[tuple, bool]:
    """Drive a probe conversation with both rules at every call: kind → they always agreed
    (a kind is in the record once a windowed call of it was compared).

    The probe, after two plain rounds: tool rounds (with reasoning where the format has a
    reasoning parser), a cut-off turn, a turn of two calls (where the template renders one),
    a summary request after tool results, an answer and a user turn; without tools, answers
    each followed by a user turn. The probe stops at a round the template refuses to render
    (the kinds seen before it stay proven)."""
    record: dict[tuple, bool] = {}
    try:
        conv = fmt.start("probe system", "probe task", tools=tools)
    except ChatFormatError:
        return record
    conv._probe = record
    name = tools[0]["function"]["name"] if tools else None
    for i in range(8):
        try:
            _probe_round(fmt, conv, name, i)
        except ChatFormatError:
            break
    return record


def _probe_round(fmt: Any, conv: Any, name: str | None, i: int) -> None:
    thought = f"probe thought {i}" if fmt.reasoning is not None else ""
    if name is None or i == 7:
        ids = fmt.turn_ids(text=f"probe answer {i}", reasoning=thought)
        conv.add_output(ids, conv.parse(ids))
        conv.delta(summarize=True)
        return
    calls = [ToolCall(name, {}), ToolCall(name, {})] if i == 5 else [ToolCall(name, {})]
    try:
        ids = fmt.turn_ids(calls=calls, reasoning=thought)
    except ChatFormatError:                          # e.g. Llama-3.1: one call a turn
        calls = calls[:1]
        ids = fmt.turn_ids(calls=calls, reasoning=thought)
    if i == 4:
        ids = ids[:-1]                                                    # cut off
    action = conv.parse(ids)
    conv.add_output(ids, action)
    n = 1 if isinstance(action, Malformed) else len(calls)
    conv.add_tool_results([f"probe result {i}.{j}" for j in range(n)], max_tokens=64)
    conv.delta(summarize=i == 6)
