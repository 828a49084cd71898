"""Tool calls in a model's own convention (vLLM's parsers) and tool schemas (OpenAI functions).

Parsing a finished turn's text (the end-of-turn token already stripped)::

    hermes       <tool_call>\\n{"name": "lookup", "arguments": {"key": 3}}\\n</tool_call>  (Qwen2.5,
                 Hermes, Qwen3 JSON; several blocks = several calls)
    llama3_json  {"name": "lookup", "parameters": {"key": 3}}; {"name": ...}       (Llama 3.x;
                 optionally after <|python_tag|>)
    mistral      [TOOL_CALLS][{"name": "lookup", "arguments": {"key": 3}, "id": "a1b2c3d4e"}]
                 (Mistral-Nemo, Mistral-Small; the 9-character id is the model's)
    granite      <|tool_call|>[{"name": "lookup", "arguments": {"key": 3}}]       (Granite 3.x)
    deepseek_v31 <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>lookup<｜tool▁sep｜>{"key": 3}
                 <｜tool▁call▁end｜><｜tool▁calls▁end｜>                                (DeepSeek-V3.1)
    qwen3_coder  <tool_call>\n<function=lookup>\n<parameter=key>\n3\n</parameter>\n</function>
                 \n</tool_call>                                       (Qwen3-Coder, XML arguments)

vLLM's own parser classes do the work (``vllm.tool_parsers``, offline: they need a tokenizer,
not a server); they return "no tool call" for text they cannot parse, so a turn that *looks*
like a call (``hermes``: holds ``<tool_call>``; ``llama3_json``: starts with ``{`` or the python
tag) but yields none is reported as malformed (invalid JSON, a missing name), never silently
taken for an answer.

Schemas: a task declares tools as ``{"type": "function", "function": {"name", "description",
"parameters": <JSON schema>}}``; :func:`check_call` returns the error text an agent sees for an
unknown tool or arguments that fail the schema (``jsonschema``), or None.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Sequence

from ray_xlong.rollout.chat import ChatFormatError, Malformed, ToolCall

PARSERS: dict[str, tuple[str, ...]] = {
    "hermes": ("<tool_call>",),
    "llama3_json": ("{", "<|python_tag|>"),
    "mistral": ("[TOOL_CALLS]",),
    "granite": ("<|tool_call|>",),
    "deepseek_v31": ("<\uff5ctool\u2581calls\u2581begin\uff5c>",),
    "qwen3_coder": ("<tool_call>", "<function="),
}
"""Supported vLLM tool parsers and the prefixes / markers that make a turn a call attempt
(a marker starting with ``<`` or ``[`` anywhere in the turn, any other at its start)."""

TEMPLATE_MARKERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("mistral", ("[TOOL_CALLS]",)),
    ("deepseek_v31", ("tool\u2581calls\u2581begin",)),
    ("granite", ("<|tool_call|>",)),
    ("qwen3_coder", ("<tool_call>", "<function=")),
    ("hermes", ("<tool_call>",)),
    ("llama3_json", ("<|python_tag|>",)),
    ("llama3_json", ("ipython",)),
)
"""How a chat template shows its tool-call convention: the first entry whose markers all
occur in the template names the parser (most specific first)."""

UNSUPPORTED_CONVENTIONS: tuple[tuple[str, str], ...] = (
    ("<|channel|>", "gpt-oss harmony channels (vLLM parser 'openai' needs the harmony encoding "
                    "and its own chat renderer, not a chat template)"),
    ("<|python_start|>", "Llama-4 pythonic calls"),
    ("<function_calls>", "Claude-style XML function calls"),
)
"""Conventions a template may show that the template format refuses by name."""


def written_calls(name: str, calls: Sequence[ToolCall]) -> str | None:
    """The text a model writes for ``calls`` in parser ``name``'s convention, where a template
    does not render tool calls itself (Granite 3.x renders only an assistant turn's content);
    None: no writer for this convention."""
    if name == "granite":
        return "<|tool_call|>" + json.dumps([{"name": c.name, "arguments": c.arguments}
                                             for c in calls])
    return None


def guess_tool_parser(template: str) -> str | None:
    """The tool parser a chat template shows (:data:`TEMPLATE_MARKERS`), or None."""
    for name, markers in TEMPLATE_MARKERS:
        if all(m in template for m in markers):
            return name
    return None


def check_parser_matches(name: str, template: str, where: str) -> None:
    """Refuse a parser whose call markers never occur in the template: the model would write
    calls the parser cannot see, and every call turn would silently become an answer."""
    markers = [m for m in PARSERS[name] if m not in ("{",)]
    if name == "llama3_json":
        markers = ["ipython", "<|python_tag|>"]
    if markers and not any(m in template for m in markers):
        shown = guess_tool_parser(template)
        advice = (f"the template shows tool_parser={shown!r}" if shown
                  else "the template shows no tool-call convention a parser handles")
        raise ChatFormatError(f"model_dir {where!r}: tool_parser {name!r} does not match the "
                              f"chat template (none of {markers} occurs in it); {advice}")


def function_schema(name: str, description: str, properties: dict[str, dict], *,
                    required: Sequence[str] | None = None) -> dict:
    """An OpenAI function tool schema (all properties required unless ``required`` is given)."""
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "properties": properties,
                       "required": list(properties if required is None else required),
                       "additionalProperties": False}}}


def as_schema(tool: dict | str) -> dict:
    """A tool schema; a bare name stands for a tool taking any object (``{"args": text}`` in
    the token format)."""
    if isinstance(tool, str):
        return {"type": "function", "function": {"name": tool, "description": "",
                                                  "parameters": {"type": "object"}}}
    if not isinstance(tool, dict) or not isinstance(tool.get("function"), dict) \
            or not isinstance(tool["function"].get("name"), str):
        raise ValueError(f"TaskEnv.tools: not an OpenAI function schema: {tool!r}")
    return tool


def tool_names(tools: Sequence[dict]) -> tuple[str, ...]:
    """Names of OpenAI function schemas."""
    return tuple(t["function"]["name"] for t in tools)


def check_call(call: ToolCall, tools: Sequence[dict]) -> str | None:
    """The error text for a call of an unknown tool or with arguments failing its schema."""
    import jsonschema

    by_name = {t["function"]["name"]: t["function"] for t in tools}
    if call.name not in by_name:
        return f"error: unknown tool {call.name!r}; tools: {', '.join(sorted(by_name))}"
    schema = by_name[call.name].get("parameters") or {"type": "object"}
    error = jsonschema.exceptions.best_match(
        jsonschema.Draft202012Validator(schema).iter_errors(call.arguments))
    if error is None:
        return None
    where = "/".join(str(p) for p in error.absolute_path) or "arguments"
    return f"error: {call.name}: {where}: {error.message}"


class ToolCallParser:
    """A vLLM tool parser used offline on one finished turn's text."""

    def __init__(self, name: str, tokenizer: Any) -> None:
        if name not in PARSERS:
            raise ChatFormatError(f"tool_parser must be one of {sorted(PARSERS)}, got {name!r} "
                                  f"(a chat-template convention no parser here handles)")
        try:
            from vllm.tool_parsers import ToolParserManager
        except ImportError as exc:               # pragma: no cover - vllm is a dependency
            raise ChatFormatError(f"tool_parser {name!r} needs vLLM's tool parsers "
                                  f"(pip install vllm): {exc}") from exc
        cls = ToolParserManager.get_tool_parser(name)
        logging.getLogger(cls.__module__).setLevel(logging.CRITICAL)   # we report failures
        try:
            self._parser = cls(tokenizer)
        except Exception as exc:  # noqa: BLE001 - e.g. a missing bot token
            raise ChatFormatError(f"tool_parser {name!r} cannot use this tokenizer: {exc}") \
                from exc
        self.name = name
        self._requests: dict[str, Any] = {}

    def parse(self, text: str, tools: Sequence[dict] = ()
              ) -> tuple[tuple[ToolCall, ...], str] | Malformed:
        """``(calls, content)`` of a turn (no calls: an answer), or :class:`Malformed`."""
        parsed = self.parse_with_ids(text, tools)
        return parsed if isinstance(parsed, Malformed) else parsed[:2]

    def _request(self, tools: Sequence[dict]):
        """A vLLM chat request carrying ``tools`` (parsers that type XML arguments by the
        schema, ``qwen3_coder``, read them from it); cached by the tools' JSON."""
        if not tools:
            return None
        key = json.dumps(list(tools), sort_keys=True)
        if key not in self._requests:
            from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

            self._requests[key] = ChatCompletionRequest(
                messages=[{"role": "user", "content": ""}], model="xlong", tools=list(tools))
        return self._requests[key]

    def parse_with_ids(self, text: str, tools: Sequence[dict] = ()
                       ) -> tuple[tuple[ToolCall, ...], str, tuple[str, ...]] | Malformed:
        """``(calls, content, ids)``: ``ids`` are the call ids the model wrote (mistral), one per
        call, or empty when it wrote none; ``tools``: the schemas offered (argument types)."""
        try:
            info = self._parser.extract_tool_calls(text, self._request(tools))
        except Exception as exc:  # noqa: BLE001 - a parser choking on odd text: malformed
            return Malformed(f"invalid tool call ({self.name}): {exc!r}")
        if not info.tools_called:
            stripped = text.lstrip()
            if any(m in text if m[0] in "<[" else stripped.startswith(m)
                   for m in PARSERS[self.name]):
                return Malformed(f"invalid tool call ({self.name}): not parseable JSON with a "
                                 f"name and arguments")
            return (), text, ()
        calls = []
        for tc in info.tool_calls:
            try:
                args = json.loads(tc.function.arguments)
            except (TypeError, ValueError):
                return Malformed(f"invalid tool call arguments for {tc.function.name!r}")
            calls.append(ToolCall(tc.function.name, args))
        content = info.content
        if content is None and self.name == "llama3_json":     # vLLM drops the text before
            content = text[:text.find("{")].replace("<|python_tag|>", "")   # the JSON
        ids = tuple(str(tc.id) for tc in info.tool_calls if tc.id and f'"{tc.id}"' in text)
        if self.name == "mistral" and len(ids) != len(calls):
            ids = _mistral_ids(text)             # vLLM's parser makes up ids of its own
        return tuple(calls), (content or ""), (ids if len(ids) == len(calls) else ())


def _mistral_ids(text: str) -> tuple[str, ...]:
    """The ``id`` fields the model wrote in ``[TOOL_CALLS][{…, "id": "…"}, …]`` (empty when the
    array does not parse or an id is missing)."""
    try:
        items = json.loads(text.split("[TOOL_CALLS]", 1)[1].strip())
    except (IndexError, ValueError):
        return ()
    if not isinstance(items, list):
        return ()
    ids = tuple(item.get("id") for item in items if isinstance(item, dict))
    return ids if ids and all(isinstance(i, str) for i in ids) else ()
