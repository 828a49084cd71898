"""An external agent as the job's task on real cells (local Ray, logical GPUs, 2 elastic cells):
each run is opened on the endpoint of the cell the driver started it on and the agent gets that
cell's base URL; its recording is processed where it ended and trained like a harness run."""

from __future__ import annotations

import json
import os
import pathlib
import sys
import tempfile

import openai
import pytest
import ray

from ray_xlong.models import build_tiny_model_dir
from ray_xlong.serving.agents import AgentTask

pytestmark = [pytest.mark.ray, pytest.mark.rllib, pytest.mark.slow]


async def url_agent(base_url: str, task: dict) -> None:
    """Two chat turns with the openai client; writes the base URL it was handed."""
    client = openai.AsyncOpenAI(base_url=base_url, api_key="none", max_retries=0)
    model = (await client.models.list()).data[0].id
    messages = [{"role": "user", "content": "hi"}]
    for _ in range(2):
        r = await client.chat.completions.create(model=model, messages=messages, max_tokens=4)
        messages += [r.choices[0].message.model_dump(exclude_none=True),
                     {"role": "user", "content": "more"}]
    await client.close()
    run_id = base_url.split("/runs/")[1].split("/")[0]
    pathlib.Path(task["out"], f"{run_id}.json").write_text(json.dumps(
        {"base_url": base_url, "pid": os.getpid()}))


def score(task: dict, outcome) -> float:
    return float(len(outcome.answer) % 2)             # varies within a group: advantages != 0


def make(out: str, seed: int) -> AgentTask:
    return AgentTask({"out": out, "seed": seed}, score, agent=url_agent)


def test_runs_get_their_cells_endpoint_and_train(tmp_path):
    import functools

    from ray_xlong.rllib.algorithm_config import XLongConfig

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])   # runners need no tests/
    model_dir = str(build_tiny_model_dir(tmp_path / "agent-chatml", seed=0, style="chatml"))
    out = tmp_path / "urls"
    out.mkdir()
    os.environ.setdefault("RAY_TMPDIR", tempfile.mkdtemp(prefix="rx", dir="/tmp"))
    ray.init(num_cpus=2, num_gpus=2, include_dashboard=False, log_to_driver=False)
    try:
        config = (XLongConfig().debugging(seed=0).lookup_recipe()
                  .training(train_batch_size_per_learner=8)
                  .xlong(mode="elastic", cells=2, runs_per_group=4, model_dir=model_dir,
                         staleness_bound=0, placement_strategy="PACK", slots_per_cell=4,
                         task="url-agent",
                         agent_task=functools.partial(make, str(out))))
        algo = config.build_algo()
        try:
            for _ in range(2):
                algo.train()
            urls = ray.get([c.runner.endpoint_url.remote() for c in algo.pool.cells])
            pids = ray.get([c.runner.__ray_call__.remote(lambda self: os.getpid())
                            for c in algo.pool.cells])
            events = algo.events()
            reports = list(algo.reports)
        finally:
            algo.stop()
    finally:
        ray.shutdown()
    assert len(set(urls)) == 2 and all(u.startswith("http://127.0.0.1:") for u in urls)
    started = {e.run: e.cell for e in events if e.kind == "run_started"}
    written = {p.stem: json.loads(p.read_text()) for p in out.glob("r*.json")}
    trained = 16                                       # 2 steps x 8 runs
    assert len(written) >= trained
    for run_id, got in written.items():                # every run: its cell's URL, its process
        cell = started[int(run_id[1:])]
        assert got["base_url"] == f"{urls[cell]}/runs/{run_id}/v1"
        assert got["pid"] == pids[cell]
    assert {started[int(r[1:])] for r in written} == {0, 1}          # both cells served runs
    assert [r.version for r in reports] == [1, 2]
    assert all(r.runs == 8 and r.tokens_trained > 0 for r in reports)
    assert all(r.trajectories_kept == 8 for r in reports)            # one trajectory a run
