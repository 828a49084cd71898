"""Reasoning in a model turn, split off by vLLM's reasoning parsers (``vllm.reasoning``).

A reasoning model writes its thoughts before the answer or the tool calls::

    <think>\\nLet me look the key up.\\n</think>\\n\\n<tool_call>…</tool_call><|im_end|>   (qwen3)
    Let me look the key up.\\n</think>\\n\\nThe answer is 47.<｜end▁of▁sentence｜>      (deepseek_r1:
                                                          the generation prompt opened <think>)

The reasoning stays in the context and in the trained tokens (the output ids are never cut);
it is excluded from the answer the harness submits and from tool-call parsing, and the endpoint
returns it as ``reasoning_content``. vLLM's parser does the split; around it two rules keep a
turn honest: a turn without the end marker has no reasoning (unless the generation prompt
opened a reasoning block, or the turn opened one itself: then it never closed, a malformed
turn), so a plain answer of a thinking-optional model is not taken for thoughts.
"""

from __future__ import annotations

import logging
from typing import Any

from ray_xlong.rollout.chat import ChatFormatError, Malformed


def reasoning_parser_names() -> tuple[str, ...]:
    """Names of the installed vLLM's reasoning parsers."""
    from vllm.reasoning import ReasoningParserManager

    names = set(getattr(ReasoningParserManager, "reasoning_parsers", {}))
    names |= set(getattr(ReasoningParserManager, "lazy_parsers", {}))
    return tuple(sorted(names))


class ReasoningParser:
    """A vLLM reasoning parser used offline on one finished turn's text."""

    def __init__(self, name: str, tokenizer: Any, *, opened: bool = False) -> None:
        try:
            from vllm.reasoning import ReasoningParserManager
        except ImportError as exc:               # pragma: no cover - vllm is a dependency
            raise ChatFormatError(f"reasoning_parser {name!r} needs vLLM (pip install vllm): "
                                  f"{exc}") from exc
        try:
            cls = ReasoningParserManager.get_reasoning_parser(name)
        except Exception as exc:  # noqa: BLE001 - an unknown name: list the known ones
            raise ChatFormatError(f"reasoning_parser must be one of "
                                  f"{list(reasoning_parser_names())}, got {name!r}") from exc
        logging.getLogger(cls.__module__).setLevel(logging.CRITICAL)
        try:
            self._parser = cls(tokenizer)
        except Exception as exc:  # noqa: BLE001 - e.g. the think tokens are missing
            raise ChatFormatError(f"reasoning_parser {name!r} cannot use this tokenizer: "
                                  f"{exc}") from exc
        self.name, self.opened = name, opened
        self.start_text, self.end_text = _markers(self._parser, tokenizer)

    def split(self, text: str) -> tuple[str, str] | Malformed:
        """``(reasoning, content)`` of a finished turn's text, or :class:`Malformed`."""
        if self.end_text and self.end_text not in text:
            if self.opened or (self.start_text and self.start_text in text):
                return Malformed(f"reasoning never closed (no {self.end_text!r})")
            return "", text
        reasoning, content = self._parser.extract_reasoning(text, None)
        return reasoning or "", content or ""


def _markers(parser: Any, tokenizer: Any) -> tuple[str | None, str | None]:
    """The start / end marker texts of a parser (attributes, else its end token ids)."""
    start, end = getattr(parser, "start_token", None), getattr(parser, "end_token", None)
    if isinstance(end, str):
        return (start if isinstance(start, str) else None), end
    ids = sorted(getattr(parser, "reasoning_end_token_ids", None) or ())
    texts = [tokenizer.convert_ids_to_tokens(i) for i in ids]    # e.g. </think>, <tool_call>
    if "</think>" in texts:
        return "<think>", "</think>"
    return None, (texts[0] if texts else None)


def guess_reasoning_parser(tokenizer: Any, template: str, generation_prompt: str
                           ) -> str | None:
    """The reasoning parser a template shows: ``</think>`` as a token of the tokenizer and in
    the template → ``deepseek_r1`` when the generation prompt opens the block, else ``qwen3``;
    gpt-oss's harmony channels → ``openai_gptoss``; else None (no reasoning)."""
    if "<|channel|>" in template and "analysis" in template:
        return "openai_gptoss"
    if "</think>" in template and "</think>" in tokenizer.get_vocab():
        opened = generation_prompt.rstrip().endswith("<think>")
        return "deepseek_r1" if opened else "qwen3"
    return None
