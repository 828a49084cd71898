"""Windowed deltas (``rollout/template_delta.py``) equal the exact rule call for call.

Each verbatim family template drives a long harness-like conversation twice: with the exact rule
(``DeltaChecks(windowed=False)``: the whole conversation rendered every call) and with the
windowed rule, no first-call checks (``first=0``), so every windowed call stands on the proof.
The ids of every delta and the rewrite counts must be equal. Templates built to break the
window's assumption (history-dependent renders) take the exact path, counted.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.rollout.families import FAMILIES, family_tokenizer
from ray_xlong.models.tokenizer import build_tokenizer
from ray_xlong.models.templates import STYLES
from ray_xlong.rollout.chat import Malformed, ToolCall
from ray_xlong.rollout.template_delta import DeltaChecks, Seen
from ray_xlong.rollout.template_format import TemplateFormat
from ray_xlong.rollout.tool_calls import function_schema

TOOLS = [function_schema("lookup", "Look a key up.", {"key": {"type": "integer"}})]
NO_SYSTEM = {"gemma-2"}                   # "System role not supported"
NO_CUT_OFF = {"mistral-nemo"}             # a cut-off turn breaks its role alternation
NO_SUMMARY = {"mistral-nemo"}             # a user turn after tool results: the same
USABLE = [f.name for f in FAMILIES if not f.refused and f.name not in NO_SYSTEM]


def drive(fmt, rounds, *, cut=True, summary=True, results=None):
    """``rounds`` tool rounds (two calls in round 1 where the template renders them, a
    cut-off turn in round 4, reasoning every third round), then a summary request; without
    tools, answers each followed by a summary request. Returns the conversation's ids."""
    tools = TOOLS if fmt.parser is not None and fmt.renders_tools else []
    conv = fmt.start("Use the tools.", "Look keys up.", tools=tools)
    ids = [conv.prompt_ids]
    for i in range(rounds):
        thought = f"step {i}" if fmt.reasoning is not None and i % 3 == 0 else ""
        if not tools:
            out = fmt.turn_ids(text=f"answer {i}", reasoning=thought)
            conv.add_output(out, conv.parse(out))
            ids += [out, conv.delta(summarize=True)]
            continue
        calls = [ToolCall("lookup", {"key": i})] * (2 if i == 1 else 1)
        try:
            out = fmt.turn_ids(calls=calls, reasoning=thought)
        except Exception:  # noqa: BLE001 - one call a turn (Llama-3.1)
            calls = calls[:1]
            out = fmt.turn_ids(calls=calls, reasoning=thought)
        if cut and i == 4:
            out = out[:-1]
        action = conv.parse(out)
        conv.add_output(out, action)
        n = 1 if isinstance(action, Malformed) else len(calls)
        texts = (results or {}).get(i) or [f"value {i}.{j} " * 4 for j in range(n)]
        conv.add_tool_results(texts[:n], max_tokens=64)
        conv.delta(commit=False)                               # as the harness does first
        ids += [out, conv.delta(summarize=summary and i == rounds - 1)]
    return ids, conv


@pytest.mark.parametrize("name", USABLE)
def test_windowed_deltas_equal_the_exact_rule_on_every_family(name):
    tok = family_tokenizer(name)
    exact = TemplateFormat(tok, delta_checks=DeltaChecks(windowed=False), where=name)
    fast = TemplateFormat(tok, delta_checks=DeltaChecks(first=0), where=name)
    kw = {"cut": name not in NO_CUT_OFF, "summary": name not in NO_SUMMARY}
    want, conv_exact = drive(exact, 12, **kw)
    got, conv_fast = drive(fast, 12, **kw)
    assert len(got) == len(want)
    for k, (a, b) in enumerate(zip(want, got)):
        assert np.array_equal(a, b), f"{name}: piece {k} differs"
    assert conv_fast.rewrites == conv_exact.rewrites
    stats = fast.delta_stats
    assert stats.windowed >= 9 and stats.mismatches == 0 and stats.unproven == 0, stats
    assert exact.delta_stats.windowed == 0


@pytest.mark.parametrize("style", STYLES)
def test_first_calls_are_checked_against_the_whole_render(style):
    fmt = TemplateFormat(build_tokenizer(style=style, vocab_size=600),
                         delta_checks=DeltaChecks(first=3, every=4))
    drive(fmt, 14, summary=False)
    s = fmt.delta_stats
    # 14 deltas: 2 whose window is the whole conversation, 12 windowed; checked: windowed
    # calls 1-3 (first) and 4, 8, 12 (every 4th) = 6
    assert s.exact == 2 and s.windowed == 12
    assert s.checked == 6 and s.mismatches == 0


def chatml_variant(old: str, new: str) -> TemplateFormat:
    tok = build_tokenizer(style="chatml", vocab_size=600)
    assert old in tok.chat_template, "the ChatML template changed: update the test"
    tok.chat_template = tok.chat_template.replace(old, new)
    return TemplateFormat(tok, delta_checks=DeltaChecks(first=0))


def test_a_template_that_numbers_messages_fails_its_proof_and_takes_the_exact_path():
    # tool results rendered with their message index: the window renumbers them
    fmt = chatml_variant("<tool_response>\\n", "<tool_response>\\n#' ~ loop.index ~ '\\n")
    exact = TemplateFormat(fmt.tokenizer, delta_checks=DeltaChecks(windowed=False))
    want, _ = drive(exact, 8, summary=False)
    got, _ = drive(fmt, 8, summary=False)
    assert all(np.array_equal(a, b) for a, b in zip(want, got))
    s = fmt.delta_stats
    assert s.windowed == 0 and s.unproven == 6, s          # every windowed-able call slow


def test_a_history_dependent_render_the_probe_missed_is_caught_by_a_check():
    # once any tool result said "ALERT", later tool results render with a mark: the probe
    # never says it; the conversation does in round 0, out of the window from call 3 on
    fmt = chatml_variant("<tool_response>\\n",
                         "<tool_response>\\n' ~ ('!' if (messages | map(attribute='content')"
                         " | select('equalto', 'ALERT') | list) else '') ~ '\\n")
    fmt.delta_checks = DeltaChecks(first=0, every=1)
    exact = TemplateFormat(fmt.tokenizer, delta_checks=DeltaChecks(windowed=False))
    results = {0: ["ALERT"]}
    want, conv_exact = drive(exact, 8, summary=False, results=results)
    got, conv_fast = drive(fmt, 8, summary=False, results=results)
    assert all(np.array_equal(a, b) for a, b in zip(want, got))
    assert conv_fast.rewrites == conv_exact.rewrites
    s = fmt.delta_stats
    assert s.mismatches >= 1 and s.checked >= 1, s            # caught, the exact result kept
    assert s.unproven >= 1, s                                   # then the kind is revoked


@pytest.mark.parametrize("field, value", [("window", 0), ("first", -1), ("every", -2),
                                          ("windowed", "yes"), ("first", True)])
def test_bad_delta_checks_name_the_field(field, value):
    with pytest.raises(ValueError, match=f"DeltaChecks.{field}"):
        DeltaChecks(**{field: value})


def test_seen_extensions_leave_the_original_alone():
    seen = Seen(2, "<p>", ("<p>",))
    a = seen.with_output("out", 2)
    b = a.with_delta("d1", end="", rewrite=False, windowed=True)
    c = a.with_delta("d2", end="<e>", rewrite=True, windowed=False)
    assert a.text() == "<p>out" and b.text() == "<p>outd1" and c.text() == "<p>out<e>d2"
    assert a.turns == ((2, 1),) and b.calls == 1 and c.diverged and not b.diverged
