"""External agents as tasks: an async callable or a subprocess, scored; crash, timeout, token
budget and a run without calls each end the run the documented way."""

from __future__ import annotations

import asyncio
import sys
import textwrap

import openai
import pytest

from ray_xlong.serving.agents import AgentTask, run_agent
from ray_xlong.serving.runs import RunLimits
from ray_xlong.trajectory import ProcessorConfig, TrajectoryProcessor
from tests.serving.conftest import MODEL, TOOLS, tool_result


async def tool_agent(base_url: str, task: dict) -> None:
    """A function-calling loop on the async client (it shares the endpoint's loop)."""
    client = openai.AsyncOpenAI(base_url=base_url, api_key="none", max_retries=0)
    messages = [{"role": "user", "content": task["question"]}]
    for _ in range(task.get("turns", 30)):
        r = await client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS)
        msg = r.choices[0].message
        messages.append(msg.model_dump(exclude_none=True))
        if not msg.tool_calls:
            return
        messages += [tool_result(tc) for tc in msg.tool_calls]


def exact(task, outcome) -> float:
    return float(outcome.answer.strip() == task["expect"])


def run(ep, spec, run_id="a1"):
    return ep.call(run_agent(ep.endpoint, spec, run_id=run_id, group_id="g"))


def test_a_callable_agent_finishes_scored_as_one_trajectory(serve):
    ep = serve()
    result = run(ep, AgentTask({"question": "key 3?", "expect": "47"}, exact, agent=tool_agent))
    assert result.run.status == "finished" and result.run.reward == 1.0
    assert len(result.run.calls) == 4 and result.info.stop_reason == "answer"
    batch = TrajectoryProcessor(ProcessorConfig(pack="none")).process([result.run])
    assert len(batch.trajectories) == 1
    assert not ep.endpoint.runs.live


def test_a_crashing_agent_fails_with_its_error(serve):
    async def crash(base_url, task):
        await tool_agent(base_url, {"question": "q", "turns": 1})
        raise RuntimeError("the agent fell over")
    result = run(ep := serve(), AgentTask({}, exact, agent=crash))
    assert result.run.status == "failed" and result.run.reward == 0.0
    assert "the agent fell over" in result.info.error and len(result.run.calls) == 1
    assert not ep.endpoint.runs.live


def test_an_agent_that_never_ends_times_out_and_is_scored(serve):
    async def hang(base_url, task):
        await tool_agent(base_url, {"question": "q", "turns": 1})
        await asyncio.sleep(3600)
    spec = AgentTask({}, lambda task, o: 0.25, agent=hang, limits=RunLimits(wall_clock_s=2.0))
    result = run(serve(), spec)
    assert (result.run.status, result.info.stop_reason, result.run.reward) == (
        "timeout", "wall_clock", 0.25)


def test_a_token_budget_ends_the_run_as_a_timeout(serve):
    spec = AgentTask({"question": "q"}, lambda task, o: 0.5, agent=tool_agent,
                     limits=RunLimits(max_run_tokens=30))
    result = run(serve(), spec)
    assert (result.run.status, result.info.stop_reason) == ("timeout", "token_budget")
    assert 1 <= len(result.run.calls) < 4 and result.run.num_tokens <= 30 + 30


def test_a_run_without_calls_fails_named(serve):
    async def idle(base_url, task):
        return None
    result = run(serve(), AgentTask({}, exact, agent=idle), run_id="idle")
    assert result.run.status == "failed" and result.info.stop_reason == "no_call"
    assert "run 'idle' ended with no model call" in result.info.error


def test_a_failing_scorer_fails_the_run(serve):
    def bad(task, outcome):
        raise KeyError("expect")
    result = run(serve(), AgentTask({"question": "q"}, bad, agent=tool_agent))
    assert result.run.status == "failed" and result.info.stop_reason == "score_error"


AGENT_SCRIPT = textwrap.dedent(f"""
    import json, os, sys
    import openai
    task = json.loads(os.environ["XLONG_TASK"])
    client = openai.OpenAI()          # OPENAI_BASE_URL / OPENAI_API_KEY from the environment
    messages = [{{"role": "user", "content": task["question"]}}]
    tools = {TOOLS!r}
    while True:
        msg = client.chat.completions.create(model="{MODEL}", messages=messages,
                                             tools=tools).choices[0].message
        messages.append(msg.model_dump(exclude_none=True))
        if not msg.tool_calls:
            print("answer:", msg.content)
            sys.exit(task.get("exit", 0))
        messages += [{{"role": "tool", "tool_call_id": tc.id, "content": "ok"}}
                     for tc in msg.tool_calls]
""")


@pytest.mark.slow
@pytest.mark.parametrize("exit_code", [0, 3])
def test_a_subprocess_agent(serve, tmp_path, exit_code):
    script = tmp_path / "agent.py"
    script.write_text(AGENT_SCRIPT)
    spec = AgentTask({"question": "key 3?", "exit": exit_code},
                     lambda task, o: float("answer: 47" in o.stdout),
                     command=[sys.executable, str(script)])
    result = run(serve(), spec)
    if exit_code == 0:
        assert result.run.status == "finished" and result.run.reward == 1.0
        assert len(result.run.calls) == 4
    else:
        assert result.run.status == "failed" and "exited with 3" in result.info.error
