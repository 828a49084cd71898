"""The template format: any HF tokenizer's own ``chat_template``, token-exact by construction.

The context is a buffer of ids. The model's output ids go in exactly as sampled (never decoded
and re-encoded); only environment messages are rendered, as the *delta* the template adds::

    prefix = render(messages)                  … <|im_start|>assistant\\n<tool_call>…<|im_end|>\\n
    full   = render(messages + new, gen=True)  … <|im_start|>assistant\\n<tool_call>…<|im_end|>\\n
                                                 <|im_start|>user\\n<tool_response>…<|im_end|>\\n
                                                 <|im_start|>assistant\\n
    cut    = just after the last assistant turn's end-of-turn token in prefix   (the model stopped
             there: the separator "\\n" the template puts after it belongs to the delta)
    delta  = encode(full[cut:])    when full[:cut] == prefix[:cut] (the template is append-only)

Wherever the template is append-only and the model writes its turns the way the template renders
them, the context equals ``apply_chat_template(conversation)`` id for id (tested for ChatML and
Llama-3 templates). Where the template rewrites history (e.g. drops earlier reasoning), the
context keeps the exact tokens the model saw, the delta is taken against a fixed two-turn
conversation instead, and ``Conversation.rewrites`` counts it (``xlong/template_rewrites``).

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
from ray_xlong.rollout.tool_calls import ToolCallParser

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
                 where: str = "tokenizer") -> None:
        self.tokenizer, self.where = tokenizer, where
        template = getattr(tokenizer, "chat_template", None)
        if not template:
            raise ChatFormatError(f"model_dir {where!r}: the tokenizer has no chat_template "
                                  f"(template format); add one or use format='token'")
        self.end_text, self.tail_text = self._end_of_turn()
        self.end_id = int(tokenizer.convert_tokens_to_ids(self.end_text))
        eos = tokenizer.eos_token_id
        self.stop_token_ids = tuple(sorted({self.end_id} | ({int(eos)} if eos is not None
                                                           else set())))
        self.pad_fallback = tokenizer.pad_token_id is None
        self.pad_token_id = int(tokenizer.pad_token_id) if not self.pad_fallback \
            else self.stop_token_ids[0]
        name = tool_parser or _guess_parser(template, where)
        self.parser = ToolCallParser(name, tokenizer)
        self.renders_tools = self._render([{"role": "user", "content": "x"}], [_PROBE_TOOL],
                                          False) != self._render([{"role": "user",
                                                                   "content": "x"}], [], False)

    # -- rendering --------------------------------------------------------------------------
    def _render(self, messages: list[dict], tools: Sequence[dict], gen: bool) -> str:
        try:
            return self.tokenizer.apply_chat_template(messages, tools=list(tools) or None,
                                                      tokenize=False, add_generation_prompt=gen)
        except Exception as exc:  # noqa: BLE001 - template errors name the directory
            raise ChatFormatError(f"model_dir {self.where!r}: the chat template failed to "
                                  f"render: {exc}") from exc

    def _end_of_turn(self) -> tuple[str, str]:
        """The token ending an assistant turn and the separator text the template puts after it."""
        text = self._render([{"role": "user", "content": "x"},
                             {"role": "assistant", "content": _MARK}], [], False)
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

    def delta_text(self, before: list[dict], new: list[dict], tools: Sequence[dict]
                   ) -> str | None:
        """Text the template appends after ``before``'s last end-of-turn; None if it rewrites."""
        prefix = self._render(before, tools, False)
        full = self._render(before + new, tools, True)
        cut = prefix.rfind(self.end_text) + len(self.end_text)
        return full[cut:] if cut >= len(self.end_text) and full[:cut] == prefix[:cut] else None

    def stable_delta_text(self, new: list[dict], tools: Sequence[dict]) -> str:
        """The delta of ``new`` after a fixed user / assistant exchange (rewriting templates)."""
        text = self.delta_text([{"role": "user", "content": "x"},
                                {"role": "assistant", "content": "y"}], new, tools)
        if text is None:
            raise ChatFormatError(f"model_dir {self.where!r}: the chat template rewrites even a "
                                  f"two-turn conversation; no delta can be taken")
        return text

    # -- the format interface ---------------------------------------------------------------
    def start(self, system: str, user: str, *, tools: Sequence[dict]
              ) -> "TemplateConversation":
        if tools and not self.renders_tools:
            raise ChatFormatError(f"model_dir {self.where!r}: the chat template ignores tools= "
                                  f"(it cannot render tool schemas); use a template that does")
        messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
        prompt = self.encode(self._render(messages, tools, True))
        return TemplateConversation(self, messages, list(tools), prompt)

    def turn_ids(self, *, calls: Sequence[ToolCall] = (), text: str = "") -> np.ndarray:
        """The template's own rendering of an assistant turn, through its end-of-turn token."""
        head = [{"role": "user", "content": "x"}]
        gen = self._render(head, [], True)
        full = self._render(head + [assistant_message(calls, text)], [], False)
        if not full.startswith(gen):
            raise ChatFormatError(f"model_dir {self.where!r}: an assistant turn does not start "
                                  f"with the generation prompt")
        body = full[len(gen):]
        return self.encode(body[:body.rindex(self.end_text) + len(self.end_text)])

    def cut_text(self, text: str, *, max_tokens: int) -> tuple[str, bool]:
        """Tool output cut to ``max_tokens`` ids (+ `` [truncated]``); only a bounded head of
        the text is tokenized."""
        limit = max_tokens * 16
        head = text[:limit].encode("utf-8", "replace").decode("utf-8")
        ids = self.tokenizer.encode(head, add_special_tokens=False)
        if len(text) <= limit and len(ids) <= max_tokens:
            return head, False
        return self.decode(ids[:max_tokens]) + " [truncated]", True


def assistant_message(calls: Sequence[ToolCall], text: str) -> dict:
    """An OpenAI-style assistant message."""
    msg: dict = {"role": "assistant", "content": text or None}
    if calls:
        msg["tool_calls"] = [{"type": "function", "function": {"name": c.name,
                                                               "arguments": c.arguments}}
                             for c in calls]
    elif not text:
        msg["content"] = ""
    return msg


def _guess_parser(template: str, where: str) -> str:
    if "<tool_call>" in template:
        return "hermes"
    if "ipython" in template or "<|python_tag|>" in template:
        return "llama3_json"
    raise ChatFormatError(f"model_dir {where!r}: cannot tell the tool-call convention from the "
                          f"chat template; give tool_parser ('hermes' | 'llama3_json')")


class TemplateConversation:
    """One agent's conversation in the template format (``chat.Conversation``)."""

    def __init__(self, fmt: TemplateFormat, messages: list[dict], tools: list[dict],
                 prompt_ids: np.ndarray) -> None:
        self.fmt, self.messages, self.tools, self.prompt_ids = fmt, messages, tools, prompt_ids
        self.rewrites = 0
        self._pending: list[dict] = []
        self._open = False

    def parse(self, output_ids: np.ndarray) -> Action:
        ids = [int(t) for t in output_ids]
        if not ids or ids[-1] not in self.fmt.stop_token_ids:
            return Malformed("cut off: no end-of-turn token (max_new_tokens reached)")
        parsed = self.fmt.parser.parse(self.fmt.decode(ids[:-1]))
        if isinstance(parsed, Malformed):
            return parsed
        calls, content = parsed
        return ToolCalls(calls, content.strip()) if calls else Answer(content.strip())

    def add_output(self, output_ids: np.ndarray, action: Action) -> None:
        ids = np.asarray(output_ids)
        self._open = not (ids.size and int(ids[-1]) in self.fmt.stop_token_ids)
        if isinstance(action, ToolCalls):
            msg = assistant_message(action.calls, action.content)
        elif isinstance(action, Answer):
            msg = assistant_message((), action.text)
        else:
            body = ids if self._open else ids[:-1]
            msg = assistant_message((), self.fmt.decode(body))
        self.messages.append(msg)

    def add_tool_results(self, texts: Sequence[str], *, max_tokens: int) -> int:
        cut = 0
        for text in texts:
            body, truncated = self.fmt.cut_text(text, max_tokens=max_tokens)
            self._pending.append({"role": "tool", "content": body})
            cut += int(truncated)
        return cut

    def delta(self, *, summarize: bool = False, commit: bool = True) -> np.ndarray:
        new = self._pending + ([{"role": "user", "content": SUMMARY_REQUEST}] if summarize
                               else [])
        if not new:
            return np.zeros(0, np.int64)
        text = self.fmt.delta_text(self.messages, new, self.tools)
        if text is None:
            text = self.fmt.stable_delta_text(new, self.tools)
            self.rewrites += int(commit)
        ids = self.fmt.encode(text)
        if self._open:
            ids = np.concatenate([[self.fmt.end_id], ids]).astype(np.int64)
        if commit:
            self.messages = self.messages + new
            self._pending, self._open = [], False
        return ids

    def compacted(self, summary_ids: np.ndarray) -> tuple[np.ndarray, "TemplateConversation"]:
        conv = TemplateConversation(self.fmt, self.messages[:2], self.tools, self.prompt_ids)
        summary = np.asarray(summary_ids)
        conv.add_output(summary, Malformed("summary"))
        conv._pending = [{"role": "user", "content": CONTINUE}]
        fresh = np.concatenate([self.prompt_ids, summary, conv.delta()]).astype(np.int64)
        return fresh, conv
