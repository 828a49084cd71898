"""The endpoint's prompts (``serving/prompts.py``) over long chats: windowed deltas equal the
exact rule request for request, the context ids grow in place without any earlier view
changing, and only the messages after the previous request's are normalized.

The requests are what an OpenAI client sends: the whole history each time, the assistant
message echoed back as returned (call ids as strings, arguments as JSON strings); each step
runs what ``app.Endpoint._chat`` runs around the engine."""

from __future__ import annotations

import json

import numpy as np
import pytest

from ray_xlong.rollout.chat import ToolCall
from ray_xlong.rollout.engine import GenerateResult
from ray_xlong.rollout.template_delta import DeltaChecks
from ray_xlong.rollout.template_format import TemplateFormat
from ray_xlong.serving import responses
from ray_xlong.serving.messages import normalize
from ray_xlong.serving.prompts import (IdBuffer, build_prompt, next_context,
                                       normalize_request)
from tests.rollout.families import family_tokenizer

TOOLS = ({"type": "function", "function": {
    "name": "note", "description": "Write a note.",
    "parameters": {"type": "object", "properties": {"text": {"type": "string"}},
                   "required": ["text"]}}},)
FAMILIES = ("qwen3", "qwen2.5", "hermes-3", "llama-3.1", "granite-3.3", "qwen3-coder",
            "mistral-nemo")


def chat(fmt, requests, *, follow_up=True):
    """``requests`` tool-call requests (then a follow-up user question); per request the
    prompt ids, whether it extended, and whether the template rewrote."""
    think = fmt.reasoning is not None
    raw = [{"role": "system", "content": "Use the tools."},
           {"role": "user", "content": "Write notes."}]
    previous, out = None, []
    for k in range(requests + int(follow_up)):
        if k == requests:
            raw = raw + [{"role": "user", "content": "And now?"}]
        messages = normalize_request(raw, previous)
        assert messages == normalize(raw)
        prompt = build_prompt(fmt, previous, messages, TOOLS)
        out.append((prompt.ids.copy(), prompt.extends, prompt.rewrite))
        ids = fmt.turn_ids(calls=[ToolCall("note", {"text": f"n{k}"})] if k < requests
                           else [], text="" if k < requests else "47",
                           reasoning=f"step {k}" if think else "")
        result = GenerateResult(ids, np.full(ids.size, -1.0), 0, "stop")
        turn = responses.parse_turn(fmt, result, tools=TOOLS)
        previous = next_context(fmt, prompt, messages, turn.normal_form(), TOOLS, ids, raw)
        if k < requests:
            echo = [{"id": i, "type": "function",
                     "function": {"name": n, "arguments": json.dumps(a)}}
                    for i, (n, a) in zip(turn.ids, turn.calls)]
            raw = raw + [{"role": "assistant", "content": turn.content or None,
                          "tool_calls": echo},
                         {"role": "tool", "tool_call_id": turn.ids[0], "content": f"ok {k}"}]
    return out


@pytest.mark.parametrize("name", FAMILIES)
def test_windowed_prompts_equal_the_exact_rule(name):
    tok = family_tokenizer(name)
    exact = TemplateFormat(tok, delta_checks=DeltaChecks(windowed=False), where=name)
    fast = TemplateFormat(tok, delta_checks=DeltaChecks(first=0), where=name)
    follow_up = name != "mistral-nemo"        # its roles must alternate: no user after tools
    want, got = chat(exact, 10, follow_up=follow_up), chat(fast, 10, follow_up=follow_up)
    for k, ((a, ea, ra), (b, eb, rb)) in enumerate(zip(want, got)):
        assert np.array_equal(a, b) and (ea, ra) == (eb, rb), f"{name}: request {k}"
    assert all(e for _, e, _ in got[1:])                       # one chain: every request extends
    s = fast.delta_stats
    assert s.windowed >= 7 and s.mismatches == 0 and s.unproven == 0, s


def test_the_context_buffer_grows_in_place_and_copies_on_a_branch():
    buf = IdBuffer(np.arange(5))
    first = buf.view()
    grown = buf.extended(5, np.array([5, 6]))
    assert grown is buf and list(grown.view()) == list(range(7))
    branch = buf.extended(5, np.array([9]))                  # a second extension of view [:5]
    assert branch is not buf and list(branch.view()) == [0, 1, 2, 3, 4, 9]
    assert list(grown.view()) == list(range(7)) and list(first) == list(range(5))
    big = buf.extended(7, np.arange(7, 3000))                # past the capacity: reallocated
    assert list(big.view()) == list(range(3000)) and list(first) == list(range(5))
    with pytest.raises(ValueError):
        first[0] = 1                                           # views are read-only


def test_an_edited_history_is_normalized_afresh_and_renders_afresh():
    fmt = TemplateFormat(family_tokenizer("qwen2.5"))
    raw = [{"role": "system", "content": "Use the tools."},
           {"role": "user", "content": "Write notes."}]
    prompt = build_prompt(fmt, None, normalize_request(raw, None), TOOLS)
    ids = fmt.turn_ids(text="47")
    result = GenerateResult(ids, np.full(ids.size, -1.0), 0, "stop")
    turn = responses.parse_turn(fmt, result, tools=TOOLS)
    previous = next_context(fmt, prompt, normalize(raw), turn.normal_form(), TOOLS, ids, raw)
    edited = [raw[0], {"role": "user", "content": "Write other notes."},
              {"role": "assistant", "content": "47"}, {"role": "user", "content": "More?"}]
    messages = normalize_request(edited, previous)
    assert messages == normalize(edited)
    again = build_prompt(fmt, previous, messages, TOOLS)
    assert not again.extends
    kept = edited[:2] + [{"role": "assistant", "content": "47"}, edited[3]]
    kept[1] = raw[1]
    assert build_prompt(fmt, previous, normalize_request(kept, previous), TOOLS).extends
