"""Contract tests with the official ``openai`` package (sync and async clients, unmodified):
multi-turn tool calling, streamed and not; returned token ids equal the recorded ones; a 20-turn
agent is one main trajectory."""

from __future__ import annotations

import asyncio

import numpy as np
import openai
import pytest

from ray_xlong.trajectory import ProcessorConfig, TrajectoryProcessor
from ray_xlong.trajectory.recording import read_runs
from tests.serving.conftest import MODEL, TOOLS, end_run, open_run, tool_policy, tool_result


def read_recording(text: str, tmp_path) -> object:
    path = tmp_path / "run.jsonl"
    path.write_text(text)
    (run,) = read_runs(str(path))
    return run


def sync_agent(base_url: str, *, max_turns: int = 30) -> list[tuple[list[int], list[int]]]:
    """A plain function-calling loop; returns (prompt_token_ids, token_ids) per call."""
    client = openai.OpenAI(base_url=base_url, api_key="none", max_retries=0)
    messages = [{"role": "system", "content": "Use the tools."},
                {"role": "user", "content": "What is key 3?"}]
    seen = []
    for _ in range(max_turns):
        r = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS,
                                           extra_body={"return_token_ids": True})
        msg = r.choices[0].message
        seen.append((r.prompt_token_ids, r.choices[0].token_ids))
        messages.append(msg.model_dump(exclude_none=True))
        if not msg.tool_calls:
            assert msg.content == "47"
            return seen
        messages += [tool_result(tc) for tc in msg.tool_calls]
    raise AssertionError("the agent did not finish")


async def async_streaming_agent(base_url: str) -> list[tuple[list[int], list[int]]]:
    """The same loop, streamed, with the async client (tool calls assembled from deltas)."""
    client = openai.AsyncOpenAI(base_url=base_url, api_key="none", max_retries=0)
    messages = [{"role": "system", "content": "Use the tools."},
                {"role": "user", "content": "What is key 3?"}]
    seen = []
    for _ in range(30):
        stream = await client.chat.completions.create(
            model=MODEL, messages=messages, tools=TOOLS, stream=True, logprobs=True,
            stream_options={"include_usage": True}, extra_body={"return_token_ids": True})
        prompt, out, text, calls = None, [], "", {}
        async for chunk in stream:
            prompt = getattr(chunk, "prompt_token_ids", None) or prompt
            for choice in chunk.choices:
                out += getattr(choice, "token_ids", None) or []
                text += choice.delta.content or ""
                for tc in choice.delta.tool_calls or []:
                    calls.setdefault(tc.index, tc)
        seen.append((prompt, out))
        msg = {"role": "assistant", "content": text or None}
        if calls:
            msg["tool_calls"] = [{"id": tc.id, "type": "function",
                                  "function": {"name": tc.function.name,
                                               "arguments": tc.function.arguments}}
                                 for tc in calls.values()]
        messages.append(msg)
        if not calls:
            return seen
        messages += [tool_result(tc) for tc in calls.values()]
    raise AssertionError("the agent did not finish")


def check_recording(run, seen) -> None:
    assert len(run.calls) == len(seen)
    for call, (prompt, out) in zip(run.calls, seen):
        assert call.input_ids.tolist() == prompt          # ids as sent to the engine
        assert call.output_ids.tolist() == out            # ids as sampled
    for prev, call in zip(run.calls, run.calls[1:]):      # each call extends the previous one
        ctx = np.concatenate([prev.input_ids, prev.output_ids])
        assert call.input_ids[:ctx.size].tolist() == ctx.tolist()


@pytest.mark.parametrize("streamed", [False, True], ids=["sync", "async-stream"])
def test_multi_turn_tool_calls_record_the_returned_ids(serve, streamed, tmp_path):
    ep = serve()
    run = open_run(ep.url, run_id="r1")
    assert run["base_url"] == f"{ep.url}/runs/r1/v1"
    seen = (asyncio.run(async_streaming_agent(run["base_url"])) if streamed
            else sync_agent(run["base_url"]))
    assert len(seen) == 4                                 # 3 tool turns (one double), answer
    r = end_run(ep.url, "r1", reward=0.5)
    assert r.status_code == 200
    rec = read_recording(r.text, tmp_path)
    assert rec.reward == 0.5 and rec.status == "finished"
    check_recording(rec, seen)


def test_twenty_turn_agent_is_one_main_trajectory(serve, fmt, tmp_path):
    ep = serve(tool_policy(fmt, turns=20))
    run = open_run(ep.url, run_id="r20")
    seen = sync_agent(run["base_url"])
    assert len(seen) == 21                                # 20 tool turns, answer
    rec = read_recording(end_run(ep.url, "r20").text, tmp_path)
    check_recording(rec, seen)
    batch = TrajectoryProcessor(ProcessorConfig(pack="none")).process([rec])
    assert [t.kind for t in batch.trajectories] == ["main"]


def test_context_equals_the_templates_full_render(serve, fmt):
    """Where the template is append-only, the exact context = apply_chat_template, id for id."""
    ep = serve()
    run = open_run(ep.url, run_id="rx")
    client = openai.OpenAI(base_url=run["base_url"], api_key="none", max_retries=0)
    messages = [{"role": "user", "content": "What is key 3?"}]
    r = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS,
                                       extra_body={"return_token_ids": True})
    messages.append(r.choices[0].message.model_dump(exclude_none=True))
    messages += [tool_result(tc) for tc in r.choices[0].message.tool_calls]
    r2 = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS,
                                        extra_body={"return_token_ids": True})
    from ray_xlong.serving.messages import normalize
    from ray_xlong.serving.prompts import render_ids

    assert r2.prompt_token_ids == render_ids(fmt, normalize(messages), TOOLS).tolist()
    assert r2.prompt_token_ids[:len(r.prompt_token_ids) + len(r.choices[0].token_ids)] == \
        r.prompt_token_ids + r.choices[0].token_ids


def test_output_the_template_would_render_differently_is_kept_as_sampled(serve, fmt, tmp_path):
    """The model writes its call in its own spacing (not the template's): the next prompt holds
    the ids as sampled, so the run is still one trajectory (a re-render would branch it)."""
    odd = '<tool_call>\n{"name":"lookup",  "arguments":{"key":1}}\n</tool_call><|im_end|>'

    def policy(ids):
        done = fmt.decode(ids).count("<tool_response>") >= 2
        return fmt.turn_ids(text="47") if done else fmt.encode(odd)
    ep = serve(policy)
    run = open_run(ep.url, run_id="odd")
    seen = sync_agent(run["base_url"])
    rec = read_recording(end_run(ep.url, "odd").text, tmp_path)
    check_recording(rec, seen)
    assert fmt.decode(np.asarray(seen[0][1])) == odd
    batch = TrajectoryProcessor(ProcessorConfig(pack="none")).process([rec])
    assert len(batch.trajectories) == 1


def test_an_edited_history_is_rendered_afresh_and_branches(serve, tmp_path):
    ep = serve()
    run = open_run(ep.url, run_id="edit")
    client = openai.OpenAI(base_url=run["base_url"], api_key="none", max_retries=0)
    messages = [{"role": "user", "content": "What is key 3?"}]
    r = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS)
    messages.append(r.choices[0].message.model_dump(exclude_none=True))
    messages += [tool_result(tc) for tc in r.choices[0].message.tool_calls]
    client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS)
    messages[0] = {"role": "user", "content": "What is key 4?"}        # the agent edits history
    client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS)
    rec = read_recording(end_run(ep.url, "edit").text, tmp_path)
    batch = TrajectoryProcessor(ProcessorConfig(pack="none")).process([rec])
    assert len(rec.calls) == 3 and len(batch.trajectories) == 2


def test_completions_with_token_ids_and_models(serve, fmt, tmp_path):
    ep = serve()
    run = open_run(ep.url, run_id="cmp")
    client = openai.OpenAI(base_url=run["base_url"], api_key="none", max_retries=0)
    assert [m.id for m in client.models.list()] == [MODEL]
    prompt = fmt.encode("<|im_start|>user\nWhat is key 3?<|im_end|>\n<|im_start|>assistant\n")
    r = client.completions.create(model=MODEL, prompt=prompt.tolist(), max_tokens=64,
                                  logprobs=1, extra_body={"return_token_ids": True})
    choice = r.choices[0]
    assert choice.prompt_token_ids == prompt.tolist() and choice.text == fmt.decode(
        np.asarray(choice.token_ids))
    rec = read_recording(end_run(ep.url, "cmp").text, tmp_path)
    assert rec.calls[0].input_ids.tolist() == prompt.tolist()
    assert rec.calls[0].output_ids.tolist() == choice.token_ids
    assert rec.calls[0].output_logprobs.tolist() == choice.logprobs.token_logprobs
