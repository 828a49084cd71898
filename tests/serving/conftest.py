"""An endpoint on a scripted engine over the ChatML template tokenizer, and agents that use it
through the official ``openai`` package (unmodified)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from ray_xlong.models.tokenizer import build_tokenizer
from ray_xlong.rollout import ScriptedEngine
from ray_xlong.rollout.chat import ToolCall
from ray_xlong.rollout.template_format import TemplateFormat
from ray_xlong.rollout.tool_calls import function_schema
from ray_xlong.serving.app import Endpoint, EndpointConfig
from ray_xlong.serving.server import ThreadedEndpoint

MODEL = "tiny"
TOOLS = [function_schema("lookup", "The value of a key.", {"key": {"type": "integer"}}),
         function_schema("note", "Write a note.", {"text": {"type": "string"}})]


@pytest.fixture(scope="session")
def fmt():
    return TemplateFormat(build_tokenizer(style="chatml", vocab_size=600))


def tool_policy(fmt, *, turns: int, delay_s: float = 0.0):
    """``turns`` tool turns (turn 1: two calls), then the answer ``47``. The turn number is
    read from the context (tool responses seen), so every run follows the same script."""
    import time

    def step(ids: np.ndarray) -> np.ndarray:
        if delay_s:
            time.sleep(delay_s)
        k = fmt.decode(ids).count("<tool_response>")
        if k >= turns + 1:
            return fmt.turn_ids(text="47")
        if k == 1:
            return fmt.turn_ids(calls=[ToolCall("lookup", {"key": 1}),
                                       ToolCall("note", {"text": "two"})])
        return fmt.turn_ids(calls=[ToolCall("lookup", {"key": k})])
    return step


def make_endpoint(fmt, policy, **config) -> Endpoint:
    engine = ScriptedEngine(policy, vocab_size=len(fmt.tokenizer))
    conf = EndpointConfig(**{"model_name": MODEL, "max_model_len": 8192, **config})
    return Endpoint(engine, tokenizer=fmt.tokenizer, fmt=fmt, config=conf)


@pytest.fixture
def serve(fmt):
    """``serve(policy=None, **EndpointConfig fields) -> ThreadedEndpoint`` (closed after)."""
    opened = []

    def start(policy=None, **config):
        ep = ThreadedEndpoint(lambda: make_endpoint(fmt, policy or tool_policy(fmt, turns=3),
                                                    **config))
        opened.append(ep)
        return ep
    yield start
    for ep in opened:
        ep.close()


def open_run(url: str, group_id: str = "g", run_id: str | None = None) -> dict:
    import httpx

    body = {"group_id": group_id} | ({"run_id": run_id} if run_id else {})
    r = httpx.post(f"{url}/runs", json=body)
    r.raise_for_status()
    return r.json()


def end_run(url: str, run_id: str, reward: float = 1.0, status: str = "finished"):
    import httpx

    return httpx.post(f"{url}/runs/{run_id}/end", json={"reward": reward, "status": status})


def tool_result(tc) -> dict:
    args = json.loads(tc.function.arguments)
    return {"role": "tool", "tool_call_id": tc.id, "content": f"{tc.function.name} = {args}"}
