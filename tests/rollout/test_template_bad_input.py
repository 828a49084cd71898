"""Bad input on the template path: each a clear error naming the directory or a recorded outcome."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest

from ray_xlong.models import build_tiny_model_dir
from ray_xlong.models.tokenizer import build_tokenizer
from ray_xlong.rollout import Harness, HarnessConfig, ScriptedEngine
from ray_xlong.rollout.chat import ChatFormatError
from ray_xlong.rollout.formats import load_chat_format
from ray_xlong.rollout.template_format import TemplateFormat
from tests.rollout.test_template_format import TOOLS, TwoTools, call

PLAIN_CHATML = (   # ChatML without tools (vLLM's template_chatml.jinja)
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\\n' }}{% endif %}")


@pytest.fixture(scope="module")
def fmt():
    return TemplateFormat(build_tokenizer(style="chatml", vocab_size=600))


@pytest.fixture(scope="module")
def chatml_dir(tmp_path_factory):
    return build_tiny_model_dir(tmp_path_factory.mktemp("chatml") / "m", style="chatml")


def raw(fmt, text, *, end=True):
    ids = fmt.encode(text)
    return np.concatenate([ids, [fmt.end_id]]).astype(np.int64) if end else ids


def run(fmt, outputs, **config):
    it = iter(outputs)
    engine = ScriptedEngine(lambda ids: next(it), vocab_size=len(fmt.tokenizer))
    cfg = HarnessConfig(**{"max_new_tokens": 64, "context_capacity": 4096,
                           "compaction_budget": 2048, **config})
    env = TwoTools()
    return asyncio.run(Harness(engine, fmt, config=cfg).run(env, run_id="r", group_id="g")), env


def test_model_dir_without_chat_template_is_an_error_naming_it(chatml_dir, tmp_path):
    tok = build_tokenizer(style="chatml")
    tok.chat_template = None
    bare = tmp_path / "bare"
    build_tiny_model_dir(bare, style="chatml")
    (bare / "chat_template.jinja").unlink()
    (bare / "xlong_chat.json").unlink()
    with pytest.raises(ChatFormatError, match=f"{bare}.*no chat_template"):
        load_chat_format(bare)
    assert isinstance(load_chat_format(chatml_dir), TemplateFormat)


def test_template_that_cannot_render_tools_is_an_error():
    tok = build_tokenizer(style="chatml", vocab_size=600)
    tok.chat_template = PLAIN_CHATML
    fmt = TemplateFormat(tok, tool_parser="hermes")
    with pytest.raises(ChatFormatError, match="ignores tools"):
        fmt.start("s", "u", tools=TOOLS)
    fmt.start("s", "u", tools=[])                               # no tools: fine


def test_vocab_mismatch_is_an_error_naming_the_directory(tmp_path):
    path = build_tiny_model_dir(tmp_path / "m", style="chatml")
    conf = json.loads((path / "config.json").read_text())
    conf["vocab_size"] = 300
    (path / "config.json").write_text(json.dumps(conf))
    with pytest.raises(ChatFormatError, match=f"{path}.*vocab_size is 300"):
        load_chat_format(path)


def test_missing_pad_falls_back_to_eos_and_missing_end_of_turn_is_an_error():
    tok = build_tokenizer(style="chatml", vocab_size=600)
    tok.pad_token = None
    fmt = TemplateFormat(tok)
    assert fmt.pad_fallback and fmt.pad_token_id in fmt.stop_token_ids
    tok = build_tokenizer(style="chatml", vocab_size=600)
    tok.chat_template = PLAIN_CHATML.replace("'<|im_end|>' + ", "")
    tok.eos_token = None
    with pytest.raises(ChatFormatError, match="no eos_token"):
        TemplateFormat(tok, tool_parser="hermes")


def test_unknown_tool_and_schema_failure_are_error_results_and_the_run_goes_on(fmt):
    result, env = run(fmt, [fmt.turn_ids(calls=[call("nope", x=1)]),
                            fmt.turn_ids(calls=[call("lookup", key="three")]),
                            fmt.turn_ids(text="done")])
    text = fmt.decode(result.run.calls[-1].input_ids)
    assert result.run.status == "finished" and result.info.tool_errors == 2
    assert "unknown tool 'nope'" in text and "'three' is not of type 'integer'" in text
    assert env.calls == []                                      # the env never saw them


@pytest.mark.parametrize("bad", [
    pytest.param('<tool_call>\n{"name": "lookup", "arguments": {"key": 3}\n</tool_call>',
                 id="invalid-json"),
    pytest.param('<tool_call>\n{"arguments": {"key": 3}}\n</tool_call>', id="no-name"),
])
def test_invalid_tool_call_json_is_malformed_retried_then_an_error_result(fmt, bad):
    result, env = run(fmt, [raw(fmt, bad), raw(fmt, bad), fmt.turn_ids(text="done")],
                      max_retries=1)
    assert result.run.status == "finished" and result.info.retries == 1
    assert "error: malformed output (invalid tool call" in fmt.decode(
        result.run.calls[-1].input_ids)


def test_call_cut_off_by_max_new_tokens_gets_the_end_token_on_the_environment_side(fmt):
    cut = raw(fmt, '<tool_call>\n{"name": "lookup", "arg', end=False)
    result, _ = run(fmt, [cut, fmt.turn_ids(text="done")], max_retries=0)
    first, last = result.run.calls
    np.testing.assert_array_equal(first.output_ids, cut)          # exactly as generated
    after = last.input_ids[first.input_ids.size + cut.size:]
    assert int(after[0]) == fmt.end_id                              # closed by the env
    assert "cut off" in fmt.decode(after)


def test_tool_results_overflowing_the_context_end_the_run_recorded(fmt):
    class Flood(TwoTools):
        async def call_tool(self, name, args):
            return "word " * 5000
    engine = ScriptedEngine(lambda ids: fmt.turn_ids(calls=[call("lookup", key=i)
                                                            for i in range(4)]),
                            vocab_size=len(fmt.tokenizer))
    cfg = HarnessConfig(max_new_tokens=96, context_capacity=1200, compaction_budget=500,
                        max_tool_output_tokens=256)
    result = asyncio.run(Harness(engine, fmt, config=cfg).run(Flood(), run_id="r",
                                                              group_id="g"))
    assert result.run.status == "timeout" and result.info.stop_reason == "context_full"
    assert len(result.run.calls) == 1 and result.info.tool_truncations == 4
