"""Verbatim chat templates of open model families, driven like the harness drives them.

Each family (``families.py``; templates and their sources in ``tests/data/templates``) gets a
tiny tokenizer carrying its template and special tokens; a scripted model writes every turn as
the template renders it. Checked per family: the tool-call parser and reasoning parser guessed
from the template, calls and reasoning parsed right, the context equal to
``apply_chat_template`` id for id where the template is append-only and rewrites counted where
it is not, compaction and follow-up user turns working, and one finished main trajectory
through the harness. Families the template format cannot serve are refused by name.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from tests.rollout.families import BY_NAME, FAMILIES, TEMPLATES, family_tokenizer
from ray_xlong.rollout import Harness, HarnessConfig, ScriptedEngine
from ray_xlong.rollout.chat import Answer, ChatFormatError, Malformed, ToolCall, ToolCalls
from ray_xlong.rollout.tasks.base import Observation
from ray_xlong.rollout.template_format import SUMMARY_REQUEST, TemplateFormat
from ray_xlong.rollout.tool_calls import function_schema

TOOLS = [function_schema("note", "Write a note.", {"text": {"type": "string"}})]
TOOL_FAMILIES = ("qwen2.5", "qwen3", "qwen3-coder", "hermes-3", "llama-3.1", "llama-3.2",
                 "mistral-nemo", "granite-3.3")
REWRITING = {"mistral-nemo": "the system message sits in the last user turn only",
             "hermes-3": "a tool turn ends '\\n<|im_end|>' once a turn follows it, "
                         "'<|im_end|>' while it is the last",
             "granite-3.3": "tool-call turns are re-rendered without their calls"}
FOLLOW_UP_REWRITES = {"qwen3", "hermes-3", "mistral-nemo", "granite-3.3"}
KWARGS = {"qwq": {"enable_thinking": True}}


@pytest.fixture(scope="module", params=TOOL_FAMILIES)
def family(request):
    fam = BY_NAME[request.param]
    return fam, TemplateFormat(family_tokenizer(fam.name))


def reasoning_of(fmt, k):
    return f"Step {k}: think first." if fmt.reasoning is not None else ""


def drive(fmt, turns):
    """Harness-like conversation: ``turns`` note calls, then the answer "47"."""
    conv = fmt.start("Use the tools.", "Write notes.", tools=TOOLS)
    ctx, outputs = list(conv.prompt_ids), []
    for k in range(turns + 1):
        ctx += list(conv.delta())
        calls = (ToolCall("note", {"text": f"n{k}"}),) if k < turns else ()
        out = fmt.turn_ids(calls=calls, text="" if calls else "47",
                           reasoning=reasoning_of(fmt, k))
        action = conv.parse(out)
        ctx += list(out)
        outputs.append(action)
        conv.add_output(out, action)
        if calls:
            conv.add_tool_results([f"noted {k}"], max_tokens=64)
    return conv, ctx, outputs


def render(fmt, conv):
    return list(fmt.tokenizer.apply_chat_template(conv.messages, tools=conv.tools,
                                                  tokenize=True)["input_ids"])


def test_parsers_guessed_from_the_template(family):
    fam, fmt = family
    assert fmt.parser.name == fam.tool_parser
    assert (fmt.reasoning.name if fmt.reasoning else None) == fam.reasoning


def test_tool_loop_is_exact_or_its_rewrites_are_counted(family):
    fam, fmt = family
    conv, ctx, outputs = drive(fmt, turns=2)
    for k, action in enumerate(outputs[:2]):
        assert isinstance(action, ToolCalls), action
        assert action.calls == (ToolCall("note", {"text": f"n{k}"}),)
        assert action.reasoning.strip() == reasoning_of(fmt, k)
    assert outputs[2] == Answer("47", outputs[2].reasoning)
    assert outputs[2].reasoning.strip() == reasoning_of(fmt, 2)
    if fam.name in REWRITING:
        assert conv.rewrites > 0 and render(fmt, conv) != ctx, REWRITING[fam.name]
    else:
        assert conv.rewrites == 0
        full = render(fmt, conv)
        assert full[:len(ctx)] == ctx                                     # id for id
        assert fmt.decode(np.asarray(full[len(ctx):])) == fmt.tail_text  # + the separator


def test_follow_up_user_turn_and_summary_request(family):
    fam, fmt = family
    conv, ctx, _ = drive(fmt, turns=1)
    before = conv.rewrites
    conv._pending = [{"role": "user", "content": "And now?"}]            # a follow-up question
    delta = conv.delta()
    text = fmt.decode(delta)
    assert "And now?" in text and text.endswith(fmt.generation_prompt)
    assert conv.rewrites - before == int(fam.name in FOLLOW_UP_REWRITES)
    out = fmt.turn_ids(text="ok")
    conv.add_output(out, conv.parse(out))
    summary = fmt.decode(conv.delta(summarize=True))
    assert SUMMARY_REQUEST in summary and summary.endswith(fmt.generation_prompt)


class Notes:
    tools = tuple(TOOLS)

    def __init__(self):
        self.calls, self.answer = [], None

    def reset(self):
        return Observation("Use the tools.", "Write notes.")

    async def call_tool(self, name, args):
        self.calls.append((name, args))
        return f"noted {len(self.calls)}"

    def submit(self, answer):
        self.answer = answer

    def score(self):
        return 1.0

    def close(self):
        pass


def scripted(fmt, *, notes):
    count = iter(range(10_000))

    def step(ids):
        text = fmt.decode(ids)
        if SUMMARY_REQUEST in text[-200:]:
            return fmt.turn_ids(text="summary: notes written", reasoning="Summing up.")
        k = next(count)
        reasoning = reasoning_of(fmt, k)
        if k >= notes:
            return fmt.turn_ids(text="47", reasoning=reasoning)
        return fmt.turn_ids(calls=[ToolCall("note", {"text": f"n{k}"})], reasoning=reasoning)
    return step


def run(fmt, *, notes, **config):
    engine = ScriptedEngine(scripted(fmt, notes=notes), vocab_size=len(fmt.tokenizer))
    cfg = HarnessConfig(**{"max_new_tokens": 96, "max_calls": 20, "context_capacity": 8192,
                           "compaction_budget": 4000, "max_subagent_depth": 0, **config})
    env = Notes()
    return asyncio.run(Harness(engine, fmt, config=cfg).run(env, run_id="r",
                                                           group_id="g")), env


def test_harness_run_one_main_trajectory_answer_without_reasoning(family):
    fam, fmt = family
    result, env = run(fmt, notes=3)
    assert result.run.status == "finished", result.info
    assert env.answer == "47"                                     # reasoning excluded
    assert [n for n, _ in env.calls] == ["note"] * 3
    calls = result.run.calls
    assert {c.agent_id for c in calls} == {"main"}
    for prev, nxt in zip(calls, calls[1:]):                       # one chain: each call
        seq = np.concatenate([prev.input_ids, prev.output_ids])  # extends the previous one
        assert np.array_equal(nxt.input_ids[:seq.size], seq)
    expected = {"mistral-nemo": 3, "granite-3.3": 3, "hermes-3": 2}
    assert result.info.template_rewrites == expected.get(fam.name, 0)


def test_harness_compaction_on_rewriting_templates(family):
    fam, fmt = family
    first, _ = run(fmt, notes=6)
    budget = first.run.calls[3].input_ids.size                   # compact mid-run
    result, env = run(fmt, notes=6, compaction_budget=budget)
    if fam.name == "mistral-nemo":     # a summary request right after tool results breaks the
        assert result.run.status == "failed"           # template's user/assistant alternation
        assert result.info.stop_reason == "chat_format" and "alternate" in result.info.error
        return
    assert result.run.status == "finished" and env.answer == "47", result.info
    assert result.info.compactions >= 1
    assert any(c.kind == "summary" for c in result.run.calls)


def test_two_llama_calls_in_one_turn_are_malformed_not_a_crash():
    fmt = TemplateFormat(family_tokenizer("llama-3.1"))
    conv = fmt.start("s", "u", tools=TOOLS)
    two = fmt.encode('{"name": "note", "parameters": {"text": "a"}}; '
                     '{"name": "note", "parameters": {"text": "b"}}<|eot_id|>')
    action = conv.parse(two)
    assert isinstance(action, Malformed) and "only supports single tool-calls" in action.reason
    engine = ScriptedEngine(lambda ids: two, vocab_size=len(fmt.tokenizer))
    cfg = HarnessConfig(max_new_tokens=64, max_calls=4, context_capacity=8192,
                        compaction_budget=4000, max_subagent_depth=0, max_retries=1)
    result = asyncio.run(Harness(engine, fmt, config=cfg).run(Notes(), run_id="r",
                                                             group_id="g"))
    assert result.run.status == "timeout" and result.info.malformed == 4    # no exception


def test_reasoning_model_without_tools_deepseek_r1_distill():
    fam = BY_NAME["deepseek-r1-distill"]
    fmt = TemplateFormat(family_tokenizer(fam.name))
    assert fmt.reasoning.name == "qwen3" and fmt.parser.name == "deepseek_v31"
    with pytest.raises(ChatFormatError, match="ignores tools"):
        fmt.start("s", "u", tools=TOOLS)
    conv = fmt.start("s", "What is 6 * 7?", tools=[])
    out = fmt.encode("<think>\nsix sevens\n</think>\n\n42<\uff5cend\u2581of\u2581sentence\uff5c>")
    assert conv.parse(out) == Answer("42", "\nsix sevens\n")
    assert conv.parse(fmt.encode("42<\uff5cend\u2581of\u2581sentence\uff5c>")) == Answer("42")


def test_reasoning_opened_by_the_generation_prompt_qwq():
    fmt = TemplateFormat(family_tokenizer("qwq"), template_kwargs={"enable_thinking": True})
    assert fmt.reasoning.name == "deepseek_r1" and fmt.reasoning.opened
    conv = fmt.start("s", "u", tools=TOOLS)
    out = fmt.turn_ids(calls=[ToolCall("note", {"text": "x"})], reasoning="plan")
    assert fmt.decode(out).startswith("plan\n</think>")
    action = conv.parse(out)
    assert action == ToolCalls((ToolCall("note", {"text": "x"}),), "", "plan\n")
    unclosed = fmt.encode("still thinking<|im_end|>")
    assert isinstance(conv.parse(unclosed), Malformed)


def test_thinking_optional_answer_is_not_taken_for_reasoning():
    fmt = TemplateFormat(family_tokenizer("qwen3"))
    conv = fmt.start("s", "u", tools=TOOLS)
    assert conv.parse(fmt.encode("plain answer<|im_end|>")) == Answer("plain answer")


@pytest.mark.parametrize("name,match", [
    ("gpt-oss", "gpt-oss harmony channels"),
    ("gemma-2", "System role not supported"),
])
def test_refused_by_name(name, match):
    with pytest.raises(ChatFormatError, match=match):
        fmt = TemplateFormat(family_tokenizer(name))
        fmt.start("s", "u", tools=[])


def test_template_without_tools_refuses_tool_runs_phi():
    fmt = TemplateFormat(family_tokenizer("phi-3.5"))
    assert fmt.parser is None
    with pytest.raises(ChatFormatError, match="ignores tools"):
        fmt.start("s", "u", tools=TOOLS)
    conv = fmt.start("s", "u", tools=[])
    assert conv.parse(fmt.encode("hello<|end|>")) == Answer("hello")


def test_wrong_parser_advice_is_refused_with_the_right_one():
    tok = family_tokenizer("mistral-nemo")
    with pytest.raises(ChatFormatError, match="tool_parser='mistral'"):
        TemplateFormat(tok, tool_parser="hermes")
    tok = family_tokenizer("granite-3.3")
    with pytest.raises(ChatFormatError, match="tool_parser='granite'"):
        TemplateFormat(tok, tool_parser="hermes")


def test_hermes3_tool_use_template_loads_and_needs_tools():
    fmt = TemplateFormat(family_tokenizer("hermes-3"))
    assert fmt.needs_tools and fmt.renders_tools


def test_every_family_has_a_recorded_source():
    sources = (TEMPLATES / "SOURCES.md").read_text()
    for fam in FAMILIES:
        assert fam.file in sources, fam.name
    assert len(FAMILIES) >= 10


def test_qwen3_coder_xml_arguments_are_typed_by_the_schema():
    fmt = TemplateFormat(family_tokenizer("qwen3-coder"))
    lookup = function_schema("lookup", "The value of a key.", {"key": {"type": "integer"}})
    conv = fmt.start("s", "u", tools=[lookup])
    out = fmt.turn_ids(calls=[ToolCall("lookup", {"key": 3})])
    assert "<parameter=key>\n3\n</parameter>" in fmt.decode(out)
    assert conv.parse(out) == ToolCalls((ToolCall("lookup", {"key": 3}),), "")   # 3, not "3"


@pytest.fixture(scope="module", params=["qwen3", "llama-3.1"])
def real(request):
    from tests.rollout.families import real_tokenizer

    tok, enc = real_tokenizer(request.param)
    return BY_NAME[request.param], TemplateFormat(tok), enc


@pytest.mark.slow
def test_real_vocabulary_tool_loop_follow_up_and_harness(real):
    """The same checks with the family's real vocabulary (``quicktok-v1``): real ids for the
    specials, real merges (encodings equal the reference encoder's)."""
    fam, fmt, enc = real
    assert len(fmt.tokenizer) == enc.n_vocab and enc.n_vocab > 128_000
    for text in ("What is key 3?", 'def f(x):\n    return {"a": 1}  # ünïcödé 12345'):
        assert fmt.encode(text).tolist() == enc.encode(text, allowed_special="all")
    assert fmt.tokenizer.convert_tokens_to_ids(fam.specials[1]) in range(128_000, enc.n_vocab)
    assert fmt.end_id == {"qwen3": 151645, "llama-3.1": 128009}[fam.name]
    assert fmt.parser.name == fam.tool_parser
    conv, ctx, outputs = drive(fmt, turns=2)
    assert conv.rewrites == 0 and render(fmt, conv)[:len(ctx)] == ctx
    assert outputs[-1] == Answer("47", outputs[-1].reasoning)
    conv._pending = [{"role": "user", "content": "And now?"}]
    assert "And now?" in fmt.decode(conv.delta())
    assert conv.rewrites == int(fam.name == "qwen3")
    result, env = run(fmt, notes=2)
    assert result.run.status == "finished" and env.answer == "47"


def test_named_templates_tool_use_chosen_and_probed_with_tools():
    """Hermes-3 ships ``{"default": …, "tool_use": …}``: agent runs take ``tool_use``, which
    renders only with tools (probed with one)."""
    from ray_xlong.models.templates import CHATML_TEMPLATE

    tok = family_tokenizer("hermes-3")
    tool_use = tok.chat_template
    try:
        tok.chat_template = {"default": CHATML_TEMPLATE, "tool_use": tool_use}
        fmt = TemplateFormat(tok)
        assert fmt.template == tool_use and fmt.needs_tools
        assert TemplateFormat(tok, template_name="default").template == CHATML_TEMPLATE
        with pytest.raises(ChatFormatError, match="template_name="):
            TemplateFormat(tok, template_name="rag")
    finally:
        tok.chat_template = tool_use


def test_deepseek_v31_calls_parse_but_tool_runs_are_refused_by_name():
    fmt = TemplateFormat(family_tokenizer("deepseek-v3.1"))
    assert fmt.parser.name == "deepseek_v31"
    with pytest.raises(ChatFormatError, match="renders tool calls \\(deepseek_v31\\)"):
        fmt.start("s", "u", tools=TOOLS)
    conv = fmt.start("s", "u", tools=[])
    two = (ToolCall("note", {"text": "x"}), ToolCall("note", {"text": "y"}))
    out = fmt.turn_ids(calls=two)
    assert fmt.decode(out).startswith("<\uff5ctool\u2581calls\u2581begin\uff5c>")
    assert conv.parse(out) == ToolCalls(two, "")
