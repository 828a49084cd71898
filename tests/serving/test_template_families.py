"""The endpoint on verbatim chat templates of open model families (``tests/rollout/families.py``):
an unmodified ``openai`` client runs a tool loop, then asks a follow-up question; reasoning
comes back as ``reasoning_content`` (never in ``content``), tool calls are parsed in the
family's convention, every request extends the previous one (one main trajectory), and a
rewriting template (Qwen3: the think block of an earlier turn disappears once a user turn
follows) is counted instead of refused."""

from __future__ import annotations

import numpy as np
import openai
import pytest

from ray_xlong.rollout import ScriptedEngine
from ray_xlong.rollout.chat import ToolCall
from ray_xlong.rollout.template_format import TemplateFormat
from ray_xlong.serving.app import Endpoint, EndpointConfig
from ray_xlong.serving.server import ThreadedEndpoint
from ray_xlong.trajectory import ProcessorConfig, TrajectoryProcessor
from tests.rollout.families import family_tokenizer
from tests.serving.conftest import end_run, open_run
from tests.serving.test_contract import read_recording

TOOLS = [{"type": "function", "function": {
    "name": "note", "description": "Write a note.",
    "parameters": {"type": "object", "properties": {"text": {"type": "string"}},
                   "required": ["text"]}}}]
FAMILIES = ("qwen3", "qwen2.5", "hermes-3", "llama-3.1", "granite-3.3", "qwen3-coder",
            "mistral-nemo")


def policy(fmt):
    think = fmt.reasoning is not None

    def step(ids):
        text = fmt.decode(ids)
        if "And now?" in text:
            return fmt.turn_ids(text="48", reasoning="again" if think else "")
        k = text.count("noted")
        if k >= 2:
            return fmt.turn_ids(text="47", reasoning="done" if think else "")
        return fmt.turn_ids(calls=[ToolCall("note", {"text": f"n{k}"})],
                            reasoning=f"step {k}" if think else "")
    return step


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    fmt = TemplateFormat(family_tokenizer(request.param))
    engine_fmt = fmt

    def make():
        engine = ScriptedEngine(policy(engine_fmt), vocab_size=len(fmt.tokenizer))
        return Endpoint(engine, tokenizer=fmt.tokenizer, fmt=fmt,
                        config=EndpointConfig(model_name="tiny", max_model_len=8192))
    ep = ThreadedEndpoint(make)
    yield request.param, fmt, ep
    ep.close()


def test_tool_loop_follow_up_reasoning_one_trajectory(family, tmp_path):
    name, fmt, ep = family
    run = open_run(ep.url, run_id=f"r-{name}")
    client = openai.OpenAI(base_url=run["base_url"], api_key="none", max_retries=0)
    messages = [{"role": "system", "content": "Use the tools."},
                {"role": "user", "content": "Write notes."}]
    replies = []
    for question in (None, "And now?"):
        if question:
            messages.append({"role": "user", "content": question})
        for _ in range(6):
            r = client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS,
                                               extra_body={"return_token_ids": True})
            msg = r.choices[0].message
            replies.append(r)
            messages.append(msg.model_dump(exclude_none=True))
            if not msg.tool_calls:
                break
            assert [tc.function.name for tc in msg.tool_calls] == ["note"]
            messages += [{"role": "tool", "tool_call_id": tc.id, "content": "noted"}
                         for tc in msg.tool_calls]
    answers = [r.choices[0].message for r in replies if not r.choices[0].message.tool_calls]
    assert [m.content for m in answers] == ["47", "48"]           # no reasoning in content
    extra = answers[0].model_extra or {}
    if fmt.reasoning is not None:
        assert extra.get("reasoning_content", "").strip() == "done"
    else:
        assert "reasoning_content" not in extra
    for prev, nxt in zip(replies, replies[1:]):                   # each request extends
        seq = prev.prompt_token_ids + prev.choices[0].token_ids
        assert nxt.prompt_token_ids[:len(seq)] == seq
    if name == "mistral-nemo":                  # the model's own 9-character call ids
        calls = [r.choices[0].message.tool_calls for r in replies]
        assert [c[0].id for c in calls if c] == ["call00001", "call00001"]
    rec = read_recording(end_run(ep.url, f"r-{name}").text, tmp_path)
    batch = TrajectoryProcessor(ProcessorConfig(pack="none")).process([rec])
    assert [t.kind for t in batch.trajectories] == ["main"]


def test_chat_refusal_names_the_reason():
    fmt = None
    tok = family_tokenizer("gemma-2")
    ep = ThreadedEndpoint(lambda: Endpoint(
        ScriptedEngine(lambda ids: np.zeros(1, np.int64), vocab_size=len(tok)),
        tokenizer=tok, fmt=fmt, config=EndpointConfig(model_name="tiny", max_model_len=512),
        chat_error="the chat template failed to render: System role not supported"))
    try:
        run = open_run(ep.url, run_id="g2")
        client = openai.OpenAI(base_url=run["base_url"], api_key="none", max_retries=0)
        with pytest.raises(openai.BadRequestError, match="System role not supported"):
            client.chat.completions.create(model="tiny",
                                           messages=[{"role": "user", "content": "hi"}])
    finally:
        ep.close()
