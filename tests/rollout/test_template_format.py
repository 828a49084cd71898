"""The template format: token-exact against a full render, id for id, for ChatML and Llama-3.

Each test drives conversations the way the harness does (model ids appended as sampled,
environment messages as deltas) and compares the context with ``apply_chat_template`` of the
whole conversation, for both template families (``models/templates.py``).
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from ray_xlong.models.templates import CHATML_TEMPLATE
from ray_xlong.models.tokenizer import build_tokenizer
from ray_xlong.rollout import Harness, HarnessConfig, ScriptedEngine
from ray_xlong.rollout.chat import Answer, Malformed, ToolCall, ToolCalls
from ray_xlong.rollout.tasks.base import Observation
from ray_xlong.rollout.template_format import CONTINUE, SUMMARY_REQUEST, TemplateFormat
from ray_xlong.rollout.tool_calls import function_schema

STYLES = ["chatml", "llama3"]
TOOLS = [function_schema("lookup", "The value of a key.", {"key": {"type": "integer"}}),
         function_schema("note", "Write a note.", {"text": {"type": "string"}})]


@pytest.fixture(scope="module", params=STYLES)
def fmt(request):
    return TemplateFormat(build_tokenizer(style=request.param, vocab_size=600))


def render_ids(fmt, messages, *, gen):
    return list(fmt.tokenizer.apply_chat_template(messages, tools=TOOLS, tokenize=True,
                                                  add_generation_prompt=gen)["input_ids"])


def call(name, **args):
    return ToolCall(name, args)


def assistant(calls=(), text=""):
    msg = {"role": "assistant", "content": text or None}
    if calls:
        msg["tool_calls"] = [{"type": "function", "function": {"name": c.name,
                                                               "arguments": c.arguments}}
                             for c in calls]
    else:
        msg["content"] = text
    return msg


def drive(fmt, turns, *, system="Use the tools.", user="What is key 3?"):
    """Run a conversation like the harness; returns (context ids, messages by hand)."""
    conv = fmt.start(system, user, tools=TOOLS)
    ctx = list(conv.prompt_ids)
    messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
    for calls, text, results in turns:
        ctx += list(conv.delta())
        out = fmt.turn_ids(calls=calls, text=text)
        action = conv.parse(out)
        assert action == (ToolCalls(tuple(calls), text) if calls else Answer(text))
        ctx += list(out)
        conv.add_output(out, action)
        messages.append(assistant(calls, text))
        if results:
            conv.add_tool_results(results, max_tokens=64)
            messages += [{"role": "tool", "content": r} for r in results]
    return conv, ctx, messages


TURNS = [([call("lookup", key=3), call("note", text="key 3 looked up")], "", ["47", "noted"]),
         ([call("lookup", key=4)], "Now key 4.", ["12"]),
         ([call("note", text="done")], "", ["noted"]),
         ((), "47", ())]


def test_context_equals_full_render_after_every_turn(fmt):
    for k in range(1, len(TURNS) + 1):
        conv, ctx, messages = drive(fmt, TURNS[:k])
        if k < len(TURNS):                        # tool results pending: flush them
            ctx += list(conv.delta())
            assert ctx == render_ids(fmt, messages, gen=True), f"after turn {k}"
        else:                                     # the answer: the template's separator follows
            full = render_ids(fmt, messages, gen=False)
            assert ctx == full[:len(ctx)]
            assert fmt.decode(full[len(ctx):]) == fmt.tail_text
    assert conv.rewrites == 0


def test_separator_after_an_assistant_turn_is_in_the_delta():
    fmt = TemplateFormat(build_tokenizer(style="chatml", vocab_size=600))
    assert fmt.end_text == "<|im_end|>" and fmt.tail_text == "\n"
    conv, _, _ = drive(fmt, TURNS[:1])
    assert fmt.decode(conv.delta()).startswith("\n<|im_start|>user\n<tool_response>\n47")
    llama = TemplateFormat(build_tokenizer(style="llama3", vocab_size=600))
    assert llama.end_text == "<|eot_id|>" and llama.tail_text == ""


def test_compaction_context_equals_full_render(fmt):
    conv, ctx, messages = drive(fmt, TURNS[:2])
    ctx += list(conv.delta(summarize=True))
    messages.append({"role": "user", "content": SUMMARY_REQUEST})
    assert ctx == render_ids(fmt, messages, gen=True)            # the summary call's input
    summary = fmt.turn_ids(text="keys 3 and 4 looked up")
    fresh, conv2 = conv.compacted(summary)
    again = [{"role": "system", "content": "Use the tools."},
             {"role": "user", "content": "What is key 3?"},
             assistant(text="keys 3 and 4 looked up"), {"role": "user", "content": CONTINUE}]
    assert list(fresh) == render_ids(fmt, again, gen=True)
    np.testing.assert_array_equal(fresh[conv2.prompt_ids.size:][:summary.size], summary)


def test_subagent_conversation_equals_full_render(fmt):
    conv, ctx, messages = drive(fmt, [([call("lookup", key=1)], "", ["20"]), ((), "20", ())],
                                system="You are a subagent.", user="Subtask: look up key 1")
    full = render_ids(fmt, messages, gen=False)
    assert ctx == full[:len(ctx)]


REWRITING = CHATML_TEMPLATE.replace(
    "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}",
    "{%- set c = message.content or '' %}{%- if not loop.last %}"
    "{%- set c = c.split('</think>')[-1] %}{%- endif %}{%- if c %}{{- '\\n' + c }}{%- endif %}")


def test_a_rewriting_template_keeps_the_exact_context_and_counts_the_rewrite():
    tok = build_tokenizer(style="chatml", vocab_size=600)
    tok.chat_template = REWRITING
    fmt = TemplateFormat(tok)
    conv = fmt.start("s", "u", tools=TOOLS)
    out = fmt.turn_ids(calls=[call("lookup", key=3)], text="<think>hmm</think>")
    conv.add_output(out, conv.parse(out))
    conv.add_tool_results(["47"], max_tokens=64)
    delta = conv.delta()
    assert conv.rewrites == 1                      # the template dropped the reasoning
    assert "<think>hmm</think>" in fmt.decode(np.concatenate([conv.prompt_ids, out, delta]))
    assert fmt.decode(delta).startswith("\n<|im_start|>user\n<tool_response>\n47")


# -- the harness on the template path ----------------------------------------------------------
class TwoTools:
    tools = tuple(TOOLS)

    def __init__(self):
        self.calls, self.answer = [], None

    def reset(self):
        return Observation("Use the tools.", "What is key 3?")

    async def call_tool(self, name, args):
        self.calls.append((name, args))
        return f"{name} ok {len(self.calls)}"

    def submit(self, answer):
        self.answer = answer

    def score(self):
        return 1.0

    def close(self):
        pass


def policy(fmt, *, turns):
    """Main: ``turns`` tool turns (turn 2: two calls, turn 3: a subagent), then an answer;
    a subagent looks key 1 up and answers; a summary call summarizes."""
    main = iter(range(10_000))

    def step(ids):
        text = fmt.decode(ids)
        if SUMMARY_REQUEST in text[-120:]:
            return fmt.turn_ids(text="progress noted")
        if "Subtask:" in text:
            done = text.count("lookup ok")
            return fmt.turn_ids(text="sub done") if done else fmt.turn_ids(
                calls=[call("lookup", key=1)])
        k = next(main)
        if k >= turns:
            return fmt.turn_ids(text="47")
        if k == 1:
            return fmt.turn_ids(calls=[call("lookup", key=3), call("note", text="two")])
        if k == 3:
            return fmt.turn_ids(calls=[call("subagent", task="look up key 1")])
        return fmt.turn_ids(calls=[call("lookup", key=k)])
    return step


class Recording:
    """Wraps a format and keeps every conversation it starts."""

    def __init__(self, fmt):
        self.fmt, self.convs = fmt, []
        self.stop_token_ids = fmt.stop_token_ids

    def start(self, system, user, *, tools):
        return self._keep(self.fmt.start(system, user, tools=tools))

    def _keep(self, conv):
        self.convs.append(conv)
        compacted = conv.compacted

        def keep_compacted(summary_ids):
            fresh, new = compacted(summary_ids)
            return fresh, self._keep(new)
        conv.compacted = keep_compacted
        return conv


def run_harness(fmt, *, turns, **config):
    rec = Recording(fmt)
    engine = ScriptedEngine(policy(fmt, turns=turns), vocab_size=len(fmt.tokenizer))
    cfg = HarnessConfig(**{"max_new_tokens": 64, "max_calls": 40, "context_capacity": 8192,
                           "compaction_budget": 4096, **config})
    env = TwoTools()
    result = asyncio.run(Harness(engine, rec, config=cfg).run(env, run_id="r", group_id="g"))
    return result, env, rec


def test_harness_calls_are_prefixes_of_their_conversations_full_render(fmt):
    result, env, rec = run_harness(fmt, turns=10, compaction_budget=560)
    run, info = result.run, result.info
    assert run.status == "finished" and env.answer == "47", info
    assert info.compactions >= 1 and info.subagents == 1 and info.template_rewrites == 0
    names = [n for n, _ in env.calls]
    assert names[1:3] == ["lookup", "note"]                 # two calls, executed in order
    renders = []
    for conv in rec.convs:
        tools = conv.tools
        renders.append(list(fmt.tokenizer.apply_chat_template(
            conv.messages, tools=tools, tokenize=True,
            add_generation_prompt=conv.messages[-1]["role"] != "assistant")["input_ids"]))
    for c in run.calls:
        seq = list(c.input_ids) + ([] if c.kind == "summary" else list(c.output_ids))
        assert any(r[:len(seq)] == seq for r in renders), (c.call_id, c.kind)


def test_two_calls_in_one_turn_are_answered_in_order(fmt):
    result, env, _ = run_harness(fmt, turns=2)
    last = result.run.calls[-1]
    text = fmt.decode(last.input_ids)
    assert text.index("lookup ok 2") < text.index("note ok 3")
    assert env.calls[1] == ("lookup", {"key": 3}) and env.calls[2] == ("note", {"text": "two"})


def test_parse_families(fmt):
    conv = fmt.start("s", "u", tools=TOOLS)
    two = fmt.turn_ids(calls=[call("lookup", key=1), call("note", text="x")])
    assert conv.parse(two) == ToolCalls((call("lookup", key=1), call("note", text="x")), "")
    assert conv.parse(fmt.turn_ids(text="the answer")) == Answer("the answer")
    assert isinstance(conv.parse(two[:-1]), Malformed)                  # cut off
