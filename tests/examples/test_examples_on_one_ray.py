"""The examples and commands that train on 2 local cells, end to end (tiny budgets), on one Ray.

Each ran in a Ray of its own (a subprocess's, or its own ``ray.init``): the ``enable`` example,
``examples/own_task.py``, ``examples/openai_agent.py``, an external agent's runs on their cells'
endpoints, ``ray-xlong train --config`` with every tracker and ``ray-xlong bench --backend
ray``. They share this module's local Ray (2 CPUs, 2 logical GPUs, idle task workers kept, as
the package's embedded Ray): each example and command uses a Ray the process is connected to as
it is (``jobs.train.ensure_ray``, ``mode_bench.run_comparison``, ``cli._train`` leaves it
running). An example runs as ``python examples/<name>.py`` would (``runpy`` as ``__main__``:
its task, agent and callbacks travel to the cells by value, as a script's do); the README's
main job keeps its own process (tests/examples/test_train_elastic.py).
"""

from __future__ import annotations

import json
import os
import pathlib
import runpy
import sys
import tempfile

import openai
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.ray, pytest.mark.slow]


@pytest.fixture(scope="module")
def local_ray():
    """One local Ray for the module (2 CPUs, 2 logical GPUs: one a cell), its workers forked
    from the zygote (``ray_xlong.zygote``): the module's ~25 cell actors share one import of
    torch, transformers and vLLM's tool parsers (529 s -> 202 s of CPU for the module, measured;
    the README's main job keeps the ordinary start)."""
    import ray

    from ray_xlong.cells.ray_edge import KEEP_TASK_WORKERS

    os.environ.setdefault("RAY_TMPDIR", tempfile.mkdtemp(prefix="rx", dir="/tmp"))
    hook = os.environ.get("RAY_RUNTIME_ENV_HOOK")
    os.environ["RAY_RUNTIME_ENV_HOOK"] = "ray_xlong.zygote.hook"
    try:
        ray.init(num_cpus=2, num_gpus=2, include_dashboard=False, log_to_driver=False,
                 _system_config=KEEP_TASK_WORKERS)
        yield
    finally:
        ray.shutdown()
        if hook is None:
            os.environ.pop("RAY_RUNTIME_ENV_HOOK", None)
        else:
            os.environ["RAY_RUNTIME_ENV_HOOK"] = hook


def run_example(name: str, *args: str, monkeypatch) -> None:
    """``python examples/<name> <args>`` in this process (exit code 0)."""
    path = str(ROOT / "examples" / name)
    monkeypatch.setattr(sys, "argv", [path, *args])
    with pytest.raises(SystemExit) as exit_:
        runpy.run_path(path, run_name="__main__")
    assert exit_.value.code == 0


# -- examples -------------------------------------------------------------------------------
def test_enable_on_existing_config_example(local_ray, monkeypatch, capsys):
    run_example("enable_on_existing_config.py", "--steps", "2", monkeypatch=monkeypatch)
    out = capsys.readouterr().out
    assert "as expected: enable: 2 setting(s)" in out
    assert "kept: lr=0.0003 grad_clip=0.5 runs/step=8" in out
    assert "step 2: reward" in out


def test_own_task_example_trains_by_name_and_by_factory(local_ray, tmp_path, monkeypatch,
                                                        capsys):
    """A task of the script trains 2 steps by name and 2 steps by factory (a JSONL dataset),
    and the second carries RLlib's evaluation block."""
    run_example("own_task.py", "--json", str(tmp_path / "own.json"), monkeypatch=monkeypatch)
    out = capsys.readouterr().out
    assert "by name step 2: reward" in out and "held-out: return" in out
    data = json.loads((tmp_path / "own.json").read_text())
    assert len(data["by_name"]) == len(data["by_factory"]) == 2
    (ev,) = data["evaluation"]
    assert (ev["num_instances"], ev["num_episodes"]) == (2, 4)
    assert 0.0 <= ev["pass_at_1"] <= ev["pass_at_2"] <= 1.0


def test_openai_agent_example_trains_on_elastic_cells(local_ray, tmp_path, warm_cache,
                                                      monkeypatch, capsys):
    """The openai agent's runs are trained on 2 elastic cells and the summary names the job."""
    run_example("openai_agent.py", "--smoke", "--workdir", str(warm_cache), "--json",
                str(tmp_path / "curve.json"), monkeypatch=monkeypatch)
    out = capsys.readouterr().out
    assert "step   2  reward" in out and "elastic on hf, seed 1" in out
    curve = json.loads((tmp_path / "curve.json").read_text())
    assert len(curve["rewards"]) == 2 and curve["runs"] == 8


# -- an external agent on the cells' endpoints -------------------------------------------------
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


def make(out: str, seed: int):
    from ray_xlong.serving.agents import AgentTask

    return AgentTask({"out": out, "seed": seed}, score, agent=url_agent)


@pytest.mark.rllib
def test_agent_runs_get_their_cells_endpoint_and_train(local_ray, tmp_path):
    """An external agent as the job's task on real cells (2 elastic cells): each run is opened
    on the endpoint of the cell the driver started it on and the agent gets that cell's base
    URL; its recording is processed where it ended and trained like a harness run."""
    import functools

    import ray

    from ray_xlong.models import build_tiny_model_dir
    from ray_xlong.rllib.algorithm_config import XLongConfig

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])   # runners need no tests/
    model_dir = str(build_tiny_model_dir(tmp_path / "agent-chatml", seed=0, style="chatml"))
    out = tmp_path / "urls"
    out.mkdir()
    config = (XLongConfig().debugging(seed=0).lookup_recipe()
              .training(train_batch_size_per_learner=8)
              .xlong(mode="elastic", cells=2, runs_per_group=4, model_dir=model_dir,
                     staleness_bound=0, placement_strategy="PACK", slots_per_cell=4,
                     task="url-agent", agent_task=functools.partial(make, str(out))))
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


# -- commands (were in tests/test_train_config.py and tests/test_cli.py) ---------------------
def test_train_from_the_tracked_example_config_writes_every_tracker(local_ray, tmp_path,
                                                                    warm_cache):
    """``ray-xlong train --config examples/configs/smoke_hf_tracked.yaml`` (one RL step of the
    lookup task through XLongAlgorithm on HF engines): the effective config, W&B offline run,
    MLflow file store and TensorBoard events are written, and the driver's event log, which
    ``ray-xlong timeline`` draws. Seed 1 in the shared model cache: the policy the main job's
    test warm-starts (``make run``'s seed and chat style), not a warm start of its own."""
    from ray_xlong.cli import main
    from ray_xlong.scheduling.events import from_jsonl
    from ray_xlong.train_config import TrainSpec, load_spec

    out = tmp_path / "out"
    assert main(["train", "--config", str(ROOT / "examples/configs/smoke_hf_tracked.yaml"),
                 "--steps", "1", "--set", f"run.out={out}", "--set", "run.seed=1",
                 "--set", f"run.workdir={warm_cache}"]) == 0
    assert load_spec(str(out / "config.yaml"), base=TrainSpec()).run.trackers == ("wandb",
                                                                                 "mlflow")
    trackers = out / "trackers"
    assert list(trackers.glob("wandb/offline-run-*/run-*.wandb"))
    assert list(trackers.glob("mlruns/*/*/metrics/learners/default_policy/policy_loss"))
    assert list(trackers.glob("ray_xlong_smoke/XLongAlgorithm_*/events.out.tfevents.*"))
    events = from_jsonl((out / "events.jsonl").read_text())
    assert {"run_started", "run_ended", "step_ended"} <= {e.kind for e in events}
    png = tmp_path / "train.png"
    assert main(["timeline", str(out / "events.jsonl"), "--time-unit", "seconds",
                 "--out", str(png)]) == 0
    assert png.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.benchmark
def test_bench_on_ray_cells_and_timeline_of_the_driver_event_log(local_ray, tmp_path, capsys):
    """``ray-xlong bench --backend ray`` (tiny budget): elastic and forecast on real Ray cells
    beside the simulator (every paper mode on cells: the modes_ray benchmark's smoke run); the
    Ray driver's event log (written as JSONL) draws through ``timeline`` like the
    simulator's."""
    from ray_xlong.cli import main
    from ray_xlong.scheduling.events import from_jsonl

    out, events = tmp_path / "bench.json", tmp_path / "ev"
    assert main(["bench", "--backend", "ray", "--size", "smoke", "--modes", "elastic",
                 "--forecast", "--json", str(out), "--events-dir", str(events)]) == 0
    assert "| mode | makespan s | sim s |" in capsys.readouterr().out
    data = json.loads(out.read_text())
    assert data["backend"] == "ray"
    assert set(data["modes"]) == {"elastic", "forecast"}
    for row in data["modes"].values():
        assert row["violations"] == [] and row["makespan_s"] > 0 and row["vs_elastic"] > 0
    ray_log = from_jsonl((events / "elastic.jsonl").read_text())
    kinds = {e.kind for e in ray_log}
    assert "micro_batch" in kinds and {"run_started", "run_ended", "step_ended"} <= kinds
    assert [e.time for e in ray_log] == sorted(e.time for e in ray_log)
    png = tmp_path / "ray.png"
    assert main(["timeline", str(events / "elastic.jsonl"), str(events / "elastic-sim.jsonl"),
                 "--time-unit", "seconds", "--out", str(png)]) == 0
    assert png.read_bytes()[:4] == b"\x89PNG"
