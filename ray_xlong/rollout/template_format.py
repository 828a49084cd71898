"""The template format: any HF tokenizer's own ``chat_template``, token-exact by construction.

The context is a buffer of ids. The model's output ids go in exactly as sampled (never decoded
and re-encoded); only environment messages are rendered, as the *delta* the template adds::

    seen   = the text of every id the model saw (prompt + outputs + deltas)
    full   = render(messages + new, gen=True)  … <|im_start|>assistant\n<tool_call>…<|im_end|>\n
                                                 <|im_start|>user\n<tool_response>…<|im_end|>\n
                                                 <|im_start|>assistant\n
    delta  = encode(full[len(seen):])          when full starts with seen (append-only)

Wherever the template is append-only and the model writes its turns the way the template renders
them, the context equals ``apply_chat_template(conversation)`` id for id. Where the render does
not start with what the model saw (the template rewrites history, e.g. Qwen3 drops the think
block of earlier turns once a user turn follows; or the model wrote a turn the template renders
otherwise), the context keeps the exact tokens the model saw, ``Conversation.rewrites`` counts
it (``xlong/template_rewrites``), and the delta is what the template renders after the last
assistant turn of the conversation itself, found by a marker in that turn
(:meth:`TemplateFormat.delta_after_last_turn`): summary requests, compaction and follow-up
user turns work on rewriting templates.

Tool calls are parsed by vLLM's tool parsers (``tool_calls.py``, guessed from the template or
given), reasoning split off by vLLM's reasoning parsers (``reasoning.py``); a turn the template
refuses to render (Llama-3.1: one call a turn) is :class:`Malformed`, with the template's reason.
Templates that render only with tools (Hermes-3 ``tool_use``) are probed with a tool.

Bad input: a tokenizer without a chat template, a template that ignores ``tools=``, no
end-of-turn token to find or no eos are :class:`ChatFormatError` naming the directory; a missing
pad token falls back to eos (``pad_fallback``). A turn cut off by ``max_new_tokens`` (no
end-of-turn id) is :class:`Malformed`; if it stays in the context, the end-of-turn id is added
on the environment side before the next delta.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from ray_xlong.rollout.chat import (Action, Answer, ChatFormatError, Malformed, ToolCall,
                                    ToolCalls)
from ray_xlong.rollout.reasoning import ReasoningParser, guess_reasoning_parser
from ray_xlong.rollout.template_delta import DeltaChecks, DeltaStats, Seen, take_delta
from ray_xlong.rollout.tool_calls import (PARSERS, UNSUPPORTED_CONVENTIONS, ToolCallParser,
                                         check_parser_matches, guess_tool_parser,
                                         written_calls)

SUMMARY_REQUEST = "Summarize your progress so far in a few words."
"""The user message of a compaction's summary call."""
CONTINUE = "Continue from your summary."
"""The user message after the summary in a compacted context."""
_MARK = "\u2063XLONG\u2063"
_PROBE_TOOL = {"type": "function", "function": {"name": "probe_tool", "description": "probe",
                                                "parameters": {"type": "object",
                                                               "properties": {}}}}


class TemplateFormat:
    """A chat format over a HF tokenizer's ``chat_template`` (see module docstring)."""

    def __init__(self, tokenizer: Any, *, tool_parser: str | None = None,
                 reasoning_parser: str | None = None, where: str = "tokenizer",
                 template_kwargs: dict | None = None, template_name: str | None = None,
                 delta_checks: DeltaChecks = DeltaChecks()) -> None:
        if not isinstance(delta_checks, DeltaChecks):
            raise ValueError(f"delta_checks must be a DeltaChecks, got {delta_checks!r}")
        self.tokenizer, self.where = tokenizer, where
        self.delta_checks, self.delta_stats = delta_checks, DeltaStats()
        self._delta_proofs: dict[str, dict[tuple, bool]] = {}
        self.template_kwargs = dict(template_kwargs or {})
        template = _choose_template(getattr(tokenizer, "chat_template", None), template_name,
                                    where)
        if not template:
            raise ChatFormatError(f"model_dir {where!r}: the tokenizer has no chat_template "
                                  f"(template format); add one or use format='token'")
        self.template = template
        self.needs_tools = False
        self.end_text, self.tail_text = self._end_of_turn()
        self.end_id = int(tokenizer.convert_tokens_to_ids(self.end_text))
        eos = tokenizer.eos_token_id
        self.stop_token_ids = tuple(sorted({self.end_id} | ({int(eos)} if eos is not None
                                                           else set())))
        self.stop_texts = tuple(sorted({tokenizer.convert_ids_to_tokens(i)
                                        for i in self.stop_token_ids}, key=len, reverse=True))
        self.pad_fallback = tokenizer.pad_token_id is None
        self.pad_token_id = int(tokenizer.pad_token_id) if not self.pad_fallback \
            else self.stop_token_ids[0]
        self.renders_tools = self._renders_tools()
        self.parser = self._tool_parser(tool_parser)
        self.generation_prompt = self._generation_prompt()
        self.reasoning = self._reasoning_parser(reasoning_parser)

    # -- probing ----------------------------------------------------------------------------
    def _probe(self, messages: list[dict], gen: bool) -> str:
        """A render of a probe conversation; with a probe tool when the template needs tools
        to render at all (tool-use templates such as Hermes-3's)."""
        try:
            return self._render(messages, [], gen)
        except ChatFormatError:
            self.needs_tools = True
            return self._render(messages, [_PROBE_TOOL], gen)

    def _renders_tools(self) -> bool:
        user = [{"role": "user", "content": "x"}]
        try:
            plain = self._render(user, [], False)
        except ChatFormatError:
            return True                                    # renders only with tools
        return self._render(user, [_PROBE_TOOL], False) != plain

    def _generation_prompt(self) -> str:
        user = [{"role": "user", "content": "x"}]
        return self._probe(user, True)[len(self._probe(user, False)):]

    def _tool_parser(self, name: str | None) -> ToolCallParser | None:
        """The tool parser given or shown by the template; None for a template that cannot
        render tools (runs with tools are then refused at ``start``, by name)."""
        if name is None:
            for marker, what in UNSUPPORTED_CONVENTIONS:
                if marker in self.template:
                    raise ChatFormatError(f"model_dir {self.where!r}: the chat template uses "
                                          f"{what}, which the template format does not "
                                          f"support; supported tool parsers: {sorted(PARSERS)}")
            name = guess_tool_parser(self.template)
            if name is None:
                if not self.renders_tools:
                    return None
                raise ChatFormatError(
                    f"model_dir {self.where!r}: the chat template renders tools but shows none "
                    f"of the tool-call conventions of {sorted(PARSERS)}; pass tool_parser= only "
                    f"if the model writes its calls in one of them")
        elif name in PARSERS and self.renders_tools:
            check_parser_matches(name, self.template, self.where)
        return ToolCallParser(name, self.tokenizer)

    def _reasoning_parser(self, name: str | None) -> ReasoningParser | None:
        if name == "none":
            return None
        name = name or guess_reasoning_parser(self.tokenizer, self.template,
                                              self.generation_prompt)
        if name is None:
            return None
        if name == "openai_gptoss":
            raise ChatFormatError(f"model_dir {self.where!r}: gpt-oss harmony channels are not "
                                  f"supported by the template format")
        parser = ReasoningParser(name, self.tokenizer)
        gen = self.generation_prompt
        parser.opened = bool(parser.start_text and parser.start_text in gen
                             and not (parser.end_text and parser.end_text
                                      in gen[gen.rindex(parser.start_text):]))
        return parser

    # -- rendering --------------------------------------------------------------------------
    def _render(self, messages: list[dict], tools: Sequence[dict], gen: bool) -> str:
        try:
            return self.tokenizer.apply_chat_template(messages, tools=list(tools) or None,
                                                      tokenize=False, add_generation_prompt=gen,
                                                      chat_template=self.template,
                                                      **self.template_kwargs)
        except Exception as exc:  # noqa: BLE001 - template errors name the directory
            raise ChatFormatError(f"model_dir {self.where!r}: the chat template failed to "
                                  f"render: {exc}") from exc

    def _end_of_turn(self) -> tuple[str, str]:
        """The token ending an assistant turn and the separator text the template puts after it."""
        text = self._probe([{"role": "user", "content": "x"},
                            {"role": "assistant", "content": _MARK}], False)
        after = text[text.rindex(_MARK) + len(_MARK):]
        specials = sorted(self.tokenizer.get_added_vocab(), key=len, reverse=True)
        for token in specials:
            if after.startswith(token):
                return token, after[len(token):]
        eos = self.tokenizer.eos_token
        if eos is None:
            raise ChatFormatError(f"model_dir {self.where!r}: no end-of-turn token after an "
                                  f"assistant turn and no eos_token: the model could not stop")
        raise ChatFormatError(f"model_dir {self.where!r}: the template puts {after[:20]!r} after"
                              f" an assistant turn, not a special token (eos {eos!r})")

    def encode(self, text: str) -> np.ndarray:
        """Rendered text → ids (special-token strings are special: it is template output)."""
        return np.asarray(self.tokenizer.encode(text, add_special_tokens=False), np.int64)

    def decode(self, ids: np.ndarray) -> str:
        """Ids → text (parsing and display only)."""
        return self.tokenizer.decode([int(t) for t in ids], skip_special_tokens=False,
                                     clean_up_tokenization_spaces=False)

    def delta_text(self, messages: list[dict], new: list[dict], tools: Sequence[dict],
                   seen: str) -> tuple[str, bool]:
        """The text the template appends for ``new`` after ``messages``, and whether the
        template rewrote what the model saw.

        ``seen`` is the text of the ids the model saw (prompt, outputs and deltas, decoded as
        appended). When the template's render of the conversation starts with it, the delta is
        the rest of the render (append-only). Otherwise the template rewrote history (or the
        model wrote a turn as the template would not): the context keeps ``seen`` and the delta
        is what the template puts after the last assistant turn, located by a marker in that
        turn (:meth:`delta_after_last_turn`).
        """
        full = self._render(messages + new, tools, True)
        if full.startswith(seen):
            return full[len(seen):], False
        return self.delta_after_last_turn(messages, new, tools), True

    def delta_after_last_turn(self, messages: list[dict], new: list[dict],
                              tools: Sequence[dict]) -> str:
        """What the template renders after the last assistant turn's end-of-turn token, for
        ``new`` (+ the generation prompt); the base is the conversation itself, only the last
        assistant turn is marked (its content + a marker, else a plain marker turn)."""
        if not messages or messages[-1].get("role") != "assistant":
            raise ChatFormatError(f"model_dir {self.where!r}: a delta needs an assistant turn "
                                  f"before the new messages")
        last = messages[-1]
        variants = ({**last, "content": (last.get("content") or "") + _MARK},
                    {"role": "assistant", "content": _MARK})
        for variant in variants:
            text = self._render(messages[:-1] + [variant] + new, tools, True)
            at = text.rfind(_MARK)
            if at < 0:
                continue
            after = text[at + len(_MARK):]
            ends = [(after.find(t), t) for t in self.stop_texts if t in after]
            if ends:
                pos, token = min(ends)
                return after[pos + len(token):]
        raise ChatFormatError(f"model_dir {self.where!r}: cannot find the end of the last "
                              f"assistant turn in the chat template's render; no delta can be "
                              f"taken")

    # -- the format interface ---------------------------------------------------------------
    def start(self, system: str, user: str, *, tools: Sequence[dict]
              ) -> "TemplateConversation":
        if tools and (not self.renders_tools or self.parser is None):
            shown = (f"; it renders tool calls ({self.parser.name}) but expects the tool "
                     f"descriptions written into the system prompt by hand, which the "
                     f"template format does not do") if self.parser is not None else ""
            raise ChatFormatError(f"model_dir {self.where!r}: the chat template ignores tools= "
                                  f"(it cannot render tool schemas){shown}; tasks with tools "
                                  f"need a template that renders them (the model's tool-use "
                                  f"template where it ships one)")
        messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
        text = self._render(messages, tools, True)
        return TemplateConversation(self, messages, list(tools), self.encode(text),
                                    Seen(len(messages), text, (text,)))

    def turn_ids(self, *, calls: Sequence[ToolCall] = (), text: str = "",
                 reasoning: str = "") -> np.ndarray:
        """The template's own rendering of an assistant turn, through its end-of-turn token
        (what a model trained on the template writes; demonstrations and scripted models)."""
        head = [{"role": "user", "content": "x"}]
        tools = [_PROBE_TOOL] if self.needs_tools else []
        gen = self._render(head, tools, True)
        ids = [f"call{i:05d}" for i in range(1, len(calls) + 1)]
        msg = assistant_message(calls, text, ids=ids, reasoning=reasoning)
        full = self._render(head + [msg], tools, False)
        common = _common_prefix(gen, full)
        if common < len(gen):              # the prompt opens more (e.g. <think>): cut at the
            common = max(gen.rfind("\n", 0, common), gen.rfind(">", 0, common)) + 1  # token
        body = full[common:]
        written = written_calls(self.parser.name, calls) if calls and self.parser else None
        if written is not None and not any(c.name in body for c in calls):
            body = f"{text}{written}{self.end_text}"      # the template drops tool calls
        if self.reasoning is not None and self.reasoning.opened and reasoning \
                and reasoning not in body:
            body = f"{reasoning}\n{self.reasoning.end_text}\n\n" + body
        ends = [(body.rfind(t), t) for t in self.stop_texts if t in body]
        if not ends:
            raise ChatFormatError(f"model_dir {self.where!r}: an assistant turn renders no "
                                  f"end-of-turn token")
        pos, token = min(ends)
        return self.encode(body[:pos + len(token)])

    def cut_text(self, text: str, *, max_tokens: int) -> tuple[str, bool]:
        """Tool output cut to ``max_tokens`` ids (+ `` [truncated]``); only a bounded head of
        the text is tokenized."""
        limit = max_tokens * 16
        head = text[:limit].encode("utf-8", "replace").decode("utf-8")
        ids = self.tokenizer.encode(head, add_special_tokens=False)
        if len(text) <= limit and len(ids) <= max_tokens:
            return head, False
        return self.decode(ids[:max_tokens]) + " [truncated]", True


def assistant_message(calls: Sequence[ToolCall], text: str, *, ids: Sequence[str] = (),
                      reasoning: str = "") -> dict:
    """An OpenAI-style assistant message (``ids``: the calls' ids; ``reasoning`` as
    ``reasoning_content``, the key HF chat templates read)."""
    msg: dict = {"role": "assistant", "content": text}
    if calls:
        msg["tool_calls"] = [{"type": "function", "function": {"name": c.name,
                                                               "arguments": c.arguments},
                              **({"id": ids[i]} if i < len(ids) else {})}
                             for i, c in enumerate(calls)]
    if reasoning:
        msg["reasoning_content"] = reasoning
    return msg


def _choose_template(template: Any, name: str | None, where: str) -> str | None:
    """The template text: a tokenizer's several named templates (``{"default": …,
    "tool_use": …}``) give ``name``, else ``tool_use`` (agent runs offer tools), else
    ``default``."""
    if not isinstance(template, dict):
        if name is not None:
            raise ChatFormatError(f"model_dir {where!r}: template_name {name!r} given but the "
                                  f"tokenizer has a single chat template")
        return template
    for choice in ((name,) if name is not None else ("tool_use", "default")):
        if choice in template:
            return template[choice]
    raise ChatFormatError(f"model_dir {where!r}: the tokenizer's chat templates are "
                          f"{sorted(template)}; choose one with template_name=")


def _common_prefix(a: str, b: str) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class TemplateConversation:
    """One agent's conversation in the template format (``chat.Conversation``).

    Besides the messages, it keeps what the model saw (:class:`~ray_xlong.rollout.template_delta
    .Seen`: the prompt and deltas as rendered, outputs as decoded, in chunks), which the
    template's renders are checked against (``rewrites``); deltas are rendered from a window
    (``template_delta.py``).
    """

    def __init__(self, fmt: TemplateFormat, messages: list[dict], tools: list[dict],
                 prompt_ids: np.ndarray, seen: Seen) -> None:
        self.fmt, self.messages, self.tools, self.prompt_ids = fmt, messages, tools, prompt_ids
        self._seen, self._prompt_seen = seen, seen
        self.rewrites = 0
        self._probe: dict | None = None
        self._cached: tuple | None = None
        self._pending: list[dict] = []
        self._ids: list[str] = []
        self._open = False
        self._calls = 0

    @property
    def seen(self) -> str:
        """The text of every id the model saw (O(n): for inspection)."""
        return self._seen.text()

    def parse(self, output_ids: np.ndarray) -> Action:
        ids = [int(t) for t in output_ids]
        if not ids or ids[-1] not in self.fmt.stop_token_ids:
            return Malformed("cut off: no end-of-turn token (max_new_tokens reached)")
        text, reasoning = self.fmt.decode(np.asarray(ids[:-1])), ""
        if self.fmt.reasoning is not None:
            split = self.fmt.reasoning.split(text)
            if isinstance(split, Malformed):
                return split
            reasoning, text = split
        if self.fmt.parser is None:
            return Answer(text.strip(), reasoning)
        parsed = self.fmt.parser.parse_with_ids(text, self.tools)
        if isinstance(parsed, Malformed):
            return parsed
        calls, content, call_ids = parsed
        if not calls:
            return Answer(content.strip(), reasoning)
        action = ToolCalls(calls, content.strip(), reasoning, call_ids)
        refusal = self._refusal(action)
        return action if refusal is None else Malformed(refusal)

    def _refusal(self, action: ToolCalls) -> str | None:
        """Why the template cannot render this turn (e.g. Llama-3.1: "only single
        tool-calls"), or None: a turn the template refuses is a malformed turn."""
        msg = assistant_message(action.calls, action.content, ids=self._call_ids(action),
                                reasoning=action.reasoning)
        try:
            self.fmt._render([{"role": "user", "content": "x"}, msg],
                             self.tools or ([_PROBE_TOOL] if self.fmt.needs_tools else []),
                             False)
        except ChatFormatError as exc:
            return f"the chat template refuses this turn: {exc.__cause__ or exc}"
        return None

    def _call_ids(self, action: ToolCalls) -> list[str]:
        """The calls' ids: the model's own (mistral), else ``callNNNNN`` (9 characters, the
        form strict templates require), numbered along the conversation."""
        if action.ids:
            return list(action.ids)
        return [f"call{self._calls + i:05d}" for i in range(1, len(action.calls) + 1)]

    def add_output(self, output_ids: np.ndarray, action: Action) -> None:
        ids = np.asarray(output_ids)
        self._open = not (ids.size and int(ids[-1]) in self.fmt.stop_token_ids)
        self._seen = self._seen.with_output(self.fmt.decode(ids), len(self.messages))
        self._cached = None
        self._ids = []
        if isinstance(action, ToolCalls):
            self._ids = self._call_ids(action)
            self._calls += len(action.calls)
            msg = assistant_message(action.calls, action.content, ids=self._ids,
                                    reasoning=action.reasoning)
        elif isinstance(action, Answer):
            msg = assistant_message((), action.text, reasoning=action.reasoning)
        else:
            body = ids if self._open else ids[:-1]
            msg = assistant_message((), self.fmt.decode(body))
        self.messages.append(msg)

    def add_tool_results(self, texts: Sequence[str], *, max_tokens: int) -> int:
        cut = 0
        for i, text in enumerate(texts):
            body, truncated = self.fmt.cut_text(text, max_tokens=max_tokens)
            if i >= len(self._ids):
                self._calls += 1
                self._ids.append(f"call{self._calls:05d}")
            self._pending.append({"role": "tool", "content": body,
                                  "tool_call_id": self._ids[i]})
            cut += int(truncated)
        self._cached = None
        return cut

    def delta(self, *, summarize: bool = False, commit: bool = True) -> np.ndarray:
        new = self._pending + ([{"role": "user", "content": SUMMARY_REQUEST}] if summarize
                               else [])
        if not new:
            return np.zeros(0, np.int64)
        key = (summarize, len(self._pending))
        if self._cached is not None and self._cached[0] == key:
            delta, ids = self._cached[1:]                # computed by a delta(commit=False)
        else:
            delta = take_delta(self.fmt, self.messages, new, self.tools, self._seen,
                               open=self._open, probe=self._probe)
            ids = self.fmt.encode(delta.text)
            if self._open:
                ids = np.concatenate([[self.fmt.end_id], ids]).astype(np.int64)
            self._cached = (key, delta, ids)
        if commit:
            self.rewrites += int(delta.rewrite)
            self.messages = self.messages + new
            self._seen = delta.seen
            self._pending, self._open, self._cached = [], False, None
        return ids

    def compacted(self, summary_ids: np.ndarray) -> tuple[np.ndarray, "TemplateConversation"]:
        conv = TemplateConversation(self.fmt, self.messages[:2], self.tools, self.prompt_ids,
                                    self._prompt_seen)
        conv._calls = self._calls
        summary = np.asarray(summary_ids)
        action = conv.parse(summary)
        conv.add_output(summary, action if isinstance(action, Answer) else Malformed("summary"))
        conv._pending = [{"role": "user", "content": CONTINUE}]
        fresh = np.concatenate([self.prompt_ids, summary, conv.delta()]).astype(np.int64)
        return fresh, conv
