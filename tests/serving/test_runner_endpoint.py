"""The endpoint on a rollout cell's runner: same engine, external-agent tasks start like
built-in ones, a draining cell refuses new endpoint runs and serves its live ones, and a cell
with a live endpoint run may not sleep."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest
from ray.rllib.algorithms.ppo import PPOConfig

from ray_xlong.models import build_tiny_model_dir
from ray_xlong.rllib.env_runner import AgentEnvRunner, RolloutConfig, RunSpec
from ray_xlong.rollout import ScriptedEngine
from ray_xlong.rollout.formats import load_chat_format
from ray_xlong.serving.agents import AgentTask, register_agent_task
from tests.serving.conftest import TOOLS, tool_policy, tool_result

pytestmark = pytest.mark.rllib


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    model_dir = str(build_tiny_model_dir(tmp_path_factory.mktemp("cell") / "cellm", seed=0,
                                         style="chatml"))
    fmt = load_chat_format(model_dir)
    cfg = RolloutConfig(model_dir=model_dir, engine_factory=lambda: ScriptedEngine(
        tool_policy(fmt, turns=2, delay_s=0.05), vocab_size=len(fmt.tokenizer)))
    runner = AgentEnvRunner(config=PPOConfig(), rollout_config=cfg)
    yield runner
    runner.stop()


async def agent(base_url: str, task: dict) -> None:
    client = openai.AsyncOpenAI(base_url=base_url, api_key="none", max_retries=0)
    messages = [{"role": "user", "content": "key?"}]
    while True:
        msg = (await client.chat.completions.create(model="cellm", messages=messages,
                                                    tools=TOOLS)).choices[0].message
        messages.append(msg.model_dump(exclude_none=True))
        if not msg.tool_calls:
            return
        messages += [tool_result(tc) for tc in msg.tool_calls]
        await asyncio.sleep(task["pause_s"])


def test_agent_tasks_run_on_the_cells_endpoint_and_drain_keeps_them(runner):
    register_agent_task("ext-lookup", lambda seed: AgentTask(
        {"pause_s": 0.3}, lambda task, o: float(o.answer == "47"), agent=agent))
    runner.start_runs([RunSpec("ext-lookup", 0, "e1", "g"), RunSpec("ext-lookup", 0, "e2", "g")])
    url = runner.endpoint_url()
    assert runner.num_live_runs() >= 2
    runner.drain()                                         # live runs go on, new ones refused
    r = httpx.post(f"{url}/runs", json={"group_id": "g"})
    assert r.status_code == 503 and "draining" in r.json()["error"]["message"]
    with pytest.raises(RuntimeError, match="live runs"):
        runner.sleep()
    results = []
    for _ in range(200):
        results += runner.sample_results()
        if len(results) == 2:
            break
        asyncio.run(asyncio.sleep(0.1))
    assert sorted(r.run.run_id for r in results) == ["e1", "e2"]
    assert all(r.run.status == "finished" and r.run.reward == 1.0 and len(r.run.calls) == 3
               for r in results)
    assert runner.num_live_runs() == 0
    runner.undrain()
    assert httpx.post(f"{url}/runs", json={"group_id": "g"}).status_code == 200
