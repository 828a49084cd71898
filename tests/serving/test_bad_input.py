"""Bad input at the endpoint: each a clear HTTP error with a reason, nothing lost."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest

from tests.serving.conftest import MODEL, TOOLS, end_run, open_run, tool_policy

HELLO = [{"role": "user", "content": "What is key 3?"}]


def chat(base_url: str, **kw):
    client = openai.OpenAI(base_url=base_url, api_key="none", max_retries=0)
    return client.chat.completions.create(**{"model": MODEL, "messages": HELLO, "tools": TOOLS,
                                             **kw})


def test_malformed_json_and_schema_failures_are_400_with_the_reason(serve):
    ep = serve()
    base = open_run(ep.url)["base_url"]
    r = httpx.post(f"{base}/chat/completions", content=b"{not json",
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and "malformed JSON" in r.json()["error"]["message"]
    r = httpx.post(f"{base}/chat/completions", json={"model": MODEL, "messages": "hi"})
    assert r.status_code == 400 and "messages" in r.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError, match="temperature"):
        chat(base, temperature="hot")
    with pytest.raises(openai.BadRequestError, match="stop strings"):
        chat(base, stop=["\n"])


def test_every_new_message_is_schema_checked_though_a_repeated_history_is_not(serve):
    # the endpoint validates only what a request adds to the agent's previous request
    # (app._unvalidated): a bad new message, or a bad edit of the history, is still a 400
    ep = serve()
    base = open_run(ep.url)["base_url"]
    msg = chat(base).choices[0].message.model_dump(exclude_none=True)
    post = lambda messages: httpx.post(f"{base}/chat/completions",    # noqa: E731
                                       json={"model": MODEL, "messages": messages,
                                             "tools": TOOLS})
    bad_new = post(HELLO + [msg, {"role": "tool", "tool_call_id": "x", "content": 5}])
    assert bad_new.status_code == 400 and "messages" in bad_new.json()["error"]["message"]
    bad_edit = post([{"role": "user", "content": 7}, msg,
                     {"role": "tool", "tool_call_id": "x", "content": "4"}])
    assert bad_edit.status_code == 400 and "messages" in bad_edit.json()["error"]["message"]
    good = post(HELLO + [msg, {"role": "tool", "tool_call_id": "x", "content": "4"}])
    assert good.status_code == 200
    rec = end_run(ep.url, base.split("/runs/")[1].split("/")[0]).text.splitlines()
    assert len(rec) == 3                                # run line + the two answered calls


def test_unknown_model_and_max_tokens_beyond_the_context(serve):
    ep = serve(max_model_len=512)
    base = open_run(ep.url)["base_url"]
    with pytest.raises(openai.NotFoundError, match="'gpt-9' does not exist"):
        chat(base, model="gpt-9")
    with pytest.raises(openai.BadRequestError, match="max_tokens 4000 is beyond the context"):
        chat(base, max_tokens=4000)
    assert chat(base, max_tokens=64).choices[0].message.tool_calls    # the run goes on


def test_unknown_or_ended_run_is_404_naming_it(serve):
    ep = serve()
    with pytest.raises(openai.NotFoundError, match="run 'nope' is not live"):
        chat(f"{ep.url}/runs/nope/v1")
    run = open_run(ep.url, run_id="done")
    chat(run["base_url"])
    assert end_run(ep.url, "done").status_code == 200
    with pytest.raises(openai.NotFoundError, match="run 'done'"):
        chat(run["base_url"])
    r = end_run(ep.url, "done")
    assert r.status_code == 404 and "'done'" in r.json()["error"]["message"]


def test_a_draining_cell_refuses_new_runs_and_serves_live_ones(serve):
    ep = serve()
    live = open_run(ep.url, run_id="live")
    assert httpx.post(f"{ep.url}/drain").json() == {"draining": True, "live_runs": 1}
    r = httpx.post(f"{ep.url}/runs", json={"group_id": "g"})
    assert r.status_code == 503 and "draining" in r.json()["error"]["message"]
    assert chat(live["base_url"]).choices[0].message.tool_calls       # live run still served
    assert end_run(ep.url, "live").status_code == 200


def test_a_run_that_ends_with_no_call_fails_named(serve):
    ep = serve()
    open_run(ep.url, run_id="empty")
    r = end_run(ep.url, "empty")
    assert r.status_code == 422
    assert "run 'empty' ended with no model call" in r.json()["error"]["message"]
    assert end_run(ep.url, "empty").status_code == 404                 # it has ended


def test_a_client_that_disconnects_mid_generation_records_nothing(serve, fmt):
    ep = serve(tool_policy(fmt, turns=3, delay_s=1.0))
    base = open_run(ep.url, run_id="gone")["base_url"]
    client = openai.OpenAI(base_url=base, api_key="none", max_retries=0, timeout=0.3)
    with pytest.raises(openai.APITimeoutError):
        chat_with(client)
    deadline = time.monotonic() + 10
    while ep.endpoint.cancelled == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert ep.endpoint.cancelled == 1
    engine = ep.endpoint.engine                      # wait for the engine's batch to finish
    while (engine.stats().busy_s == 0 or engine.num_running()) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine.stats().busy_s > 0 and engine.num_running() == 0
    assert ep.endpoint.runs.get("gone").calls == []  # not recorded, not half-recorded
    assert end_run(ep.url, "gone").status_code == 422


def chat_with(client):
    return client.chat.completions.create(model=MODEL, messages=HELLO, tools=TOOLS)


def test_a_flood_is_refused_with_429_and_retry_after(serve, fmt):
    ep = serve(tool_policy(fmt, turns=3, delay_s=0.3), max_queue=2, retry_after_s=3)
    base = open_run(ep.url, run_id="flood")["base_url"]

    async def one(client):
        try:
            await client.chat.completions.create(model=MODEL, messages=HELLO, tools=TOOLS)
            return "ok"
        except openai.RateLimitError as exc:
            assert exc.response.headers["retry-after"] == "3"
            assert "max_queue 2" in exc.message
            return "429"

    async def flood():
        client = openai.AsyncOpenAI(base_url=base, api_key="none", max_retries=0)
        return await asyncio.gather(*(one(client) for _ in range(8)))
    outcomes = asyncio.run(flood())
    assert outcomes.count("429") >= 1 and outcomes.count("ok") >= 1
    assert len(ep.endpoint.runs.get("flood").calls) == outcomes.count("ok")   # nothing lost


def test_an_agent_that_never_ends_times_out(serve):
    ep = serve(limits=__import__("ray_xlong.serving.runs", fromlist=["RunLimits"])
               .RunLimits(wall_clock_s=1.5))
    base = open_run(ep.url, run_id="slow")["base_url"]
    chat(base)
    time.sleep(1.7)
    with pytest.raises(openai.ConflictError, match="past its wall clock"):
        chat(base)
    r = end_run(ep.url, "slow", reward=0.25, status="finished")
    assert r.status_code == 200 and '"status":"timeout"' in r.text.splitlines()[0]


def test_agent_header_kinds_and_bad_headers(serve, tmp_path):
    from ray_xlong.trajectory.recording import read_runs

    ep = serve()
    base = open_run(ep.url, run_id="multi")["base_url"]
    chat(base)
    chat(base, extra_headers={"X-Xlong-Agent": "helper;kind=subagent;parent=main"})
    chat(base, extra_headers={"X-Xlong-Agent": "main;kind=summary"})
    with pytest.raises(openai.BadRequestError, match="kind 'boss'"):
        chat(base, extra_headers={"X-Xlong-Agent": "x;kind=boss"})
    with pytest.raises(openai.BadRequestError, match="parent 'ghost' names no agent"):
        chat(base, extra_headers={"X-Xlong-Agent": "s2;kind=subagent;parent=ghost"})
    path = tmp_path / "r.jsonl"
    path.write_text(end_run(ep.url, "multi").text)
    (run,) = read_runs(str(path))
    assert [(c.agent_id, c.kind, c.parent_agent_id) for c in run.calls] == [
        ("main", "main", None), ("helper", "subagent", "main"), ("main", "summary", None)]


def test_a_run_nobody_ends_is_reaped_as_timeout_nothing_lost(serve):
    from ray_xlong.serving.runs import RunLimits

    ep = serve(limits=RunLimits(wall_clock_s=1.0))
    base = open_run(ep.url, run_id="abandoned")["base_url"]
    chat(base)
    open_run(ep.url, run_id="never-called")
    time.sleep(2.2)
    assert httpx.get(f"{ep.url}/health").json()["live_runs"] == 0
    reaped = {r.run_id: r for r in ep.endpoint.runs.abandoned}
    assert reaped["abandoned"].status == "timeout" and len(reaped["abandoned"].calls) == 1
    assert reaped["never-called"].status == "failed"
    with pytest.raises(openai.NotFoundError, match="'abandoned'"):
        chat(base)
