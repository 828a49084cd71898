"""The endpoint vs the in-process harness on the same concurrent multi-turn tool-calling runs.

Both paths drive the same scripted engine policy (ChatML template, Hermes tool calls: ``turns``
tool turns, then an answer) from one process, side by side:

* **harness** — ``Harness.run_many`` (the built-in agent loop, engine calls in-process);
* **endpoint** — ``runs`` concurrent agents written against ``openai.AsyncOpenAI`` talking HTTP
  to an :class:`~ray_xlong.serving.app.Endpoint` (uvicorn on its own loop and thread).

Per-call overhead of the endpoint = client-observed latency of a call − the engine time the
endpoint recorded for it (``ModelCall.end_time - start_time``): HTTP, JSON, schema validation,
message normalization, the prompt delta, tool-call parsing, the response, and the ``openai``
client's own work (it runs in this process, sharing the GIL with the server). Measured once
with one run at a time (the call's own cost) and once under the concurrent runs (+ queueing
behind the other runs' requests on the endpoint's one event loop). Throughput = model
calls per second of wall time; the ratio is endpoint ÷ harness. Trajectories per run come from
the trajectory processor on each path's recorded runs.

    python benchmarks/endpoint.py [--seed 0] [--runs 16] [--turns 10] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import pathlib
import sys
import time

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from ray_xlong.models.tokenizer import build_tokenizer  # noqa: E402
from ray_xlong.rollout import Harness, HarnessConfig, ScriptedEngine  # noqa: E402
from ray_xlong.rollout.chat import ToolCall  # noqa: E402
from ray_xlong.rollout.tasks.base import Observation  # noqa: E402
from ray_xlong.rollout.template_format import TemplateFormat  # noqa: E402
from ray_xlong.rollout.tool_calls import function_schema  # noqa: E402
from ray_xlong.trajectory import ProcessorConfig, TrajectoryProcessor  # noqa: E402

TOOLS = [function_schema("lookup", "The value of a key.", {"key": {"type": "integer"}})]


def policy(fmt: TemplateFormat, turns: int):
    def step(ids: np.ndarray) -> np.ndarray:
        k = fmt.decode(ids).count("<tool_response>")
        if k >= turns:
            return fmt.turn_ids(text="47")
        return fmt.turn_ids(calls=[ToolCall("lookup", {"key": k})])
    return step


class LookupEnv:
    tools = tuple(TOOLS)

    def reset(self):
        return Observation("Use the tools.", "What is key 3?")

    async def call_tool(self, name, args):
        return f"lookup = {args}"

    def submit(self, answer):
        pass

    def score(self):
        return 1.0

    def close(self):
        pass


async def harness_path(fmt, *, runs: int, turns: int, seed: int) -> dict:
    engine = ScriptedEngine(policy(fmt, turns), vocab_size=len(fmt.tokenizer), seed=seed)
    cfg = HarnessConfig(max_new_tokens=64, max_calls=turns + 4, context_capacity=16384,
                        compaction_budget=12000, max_subagent_depth=0)
    harness = Harness(engine, fmt, config=cfg)
    t0 = time.perf_counter()
    results = await harness.run_many([LookupEnv() for _ in range(runs)],
                                     run_ids=[f"h{i}" for i in range(runs)],
                                     group_ids=["g"] * runs)
    wall = time.perf_counter() - t0
    await engine.close()
    return {"wall_s": wall, "runs": [r.run for r in results], "latencies": []}


async def agent(base_url: str, latencies: list[float]) -> None:
    import openai

    client = openai.AsyncOpenAI(base_url=base_url, api_key="none", max_retries=0)
    messages = [{"role": "system", "content": "Use the tools."},
                {"role": "user", "content": "What is key 3?"}]
    while True:
        t = time.perf_counter()
        r = await client.chat.completions.create(model="bench", messages=messages, tools=TOOLS,
                                                 max_tokens=64)
        latencies.append(time.perf_counter() - t)
        msg = r.choices[0].message
        messages.append(msg.model_dump(exclude_none=True))
        if not msg.tool_calls:
            await client.close()
            return
        messages += [{"role": "tool", "tool_call_id": tc.id,
                      "content": f"lookup = {json.loads(tc.function.arguments)}"}
                     for tc in msg.tool_calls]


def endpoint_path(fmt, *, runs: int, turns: int, seed: int) -> dict:
    import httpx

    from ray_xlong.serving.app import Endpoint, EndpointConfig
    from ray_xlong.serving.server import ThreadedEndpoint
    from ray_xlong.trajectory.recording import read_runs

    def make() -> Endpoint:
        engine = ScriptedEngine(policy(fmt, turns), vocab_size=len(fmt.tokenizer), seed=seed)
        return Endpoint(engine, tokenizer=fmt.tokenizer, fmt=fmt,
                        config=EndpointConfig(model_name="bench", max_model_len=16384))
    with ThreadedEndpoint(make) as ep:
        urls = [httpx.post(f"{ep.url}/runs", json={"group_id": "g", "run_id": f"e{i}"}).json()
                ["base_url"] for i in range(runs)]
        latencies: list[list[float]] = [[] for _ in range(runs)]

        async def all_agents() -> None:
            await asyncio.gather(*(agent(u, lat) for u, lat in zip(urls, latencies)))
        t0 = time.perf_counter()
        asyncio.run(all_agents())
        wall = time.perf_counter() - t0
        recorded, tmp = [], pathlib.Path(f"/tmp/xlong_endpoint_bench_{seed}.jsonl")
        for i in range(runs):
            tmp.write_text(httpx.post(f"{ep.url}/runs/e{i}/end", json={"reward": 1.0}).text)
            recorded += read_runs(str(tmp))
        tmp.unlink()
    overhead = [lat - (c.end_time - c.start_time)
                for run, lats in zip(recorded, latencies) for c, lat in zip(run.calls, lats)]
    return {"wall_s": wall, "runs": recorded, "overhead": overhead}


def summarize(path: dict) -> dict:
    runs = path["runs"]
    calls = sum(len(r.calls) for r in runs)
    batch = TrajectoryProcessor(ProcessorConfig(pack="none")).process(runs)
    return {"calls": calls, "wall_s": path["wall_s"], "calls_per_s": calls / path["wall_s"],
            "trajectories_per_run": len(batch.trajectories) / len(runs),
            "finished": sum(r.status == "finished" for r in runs)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--runs", type=int, default=16, help="concurrent runs per path")
    parser.add_argument("--turns", type=int, default=10, help="tool turns per run")
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args(argv)
    fmt = TemplateFormat(build_tokenizer(style="chatml", vocab_size=600))
    harness = harness_path_sync(fmt, args)
    endpoint = endpoint_path(fmt, runs=args.runs, turns=args.turns, seed=args.seed)
    alone = endpoint_path(fmt, runs=1, turns=args.turns, seed=args.seed)
    h, e = summarize(harness), summarize(endpoint)
    ms = np.asarray(alone["overhead"][1:]) * 1e3          # one run, warm: the call's own cost
    loaded = np.asarray(endpoint["overhead"]) * 1e3      # concurrent runs: + queueing
    result = {"seed": args.seed, "runs": args.runs, "turns": args.turns, "harness": h,
              "endpoint": e, "overhead_ms_p50": float(np.percentile(ms, 50)),
              "overhead_ms_p99": float(np.percentile(ms, 99)),
              "overhead_concurrent_ms_p50": float(np.percentile(loaded, 50)),
              "overhead_concurrent_ms_p99": float(np.percentile(loaded, 99)),
              "throughput_ratio": e["calls_per_s"] / h["calls_per_s"]}
    print(f"{args.runs} concurrent runs x {args.turns} tool turns, seed {args.seed} "
          f"(both paths in one process, side by side)\n")
    print("| path | calls | wall s | calls/s | trajectories/run | finished |")
    print("|---|---|---|---|---|---|")
    for name, row in (("harness (in-process)", h), ("endpoint (openai client, HTTP)", e)):
        print(f"| {name} | {row['calls']} | {row['wall_s']:.2f} | {row['calls_per_s']:.1f} | "
              f"{row['trajectories_per_run']:.2f} | {row['finished']}/{args.runs} |")
    print(f"\nendpoint per-call overhead, one run at a time: p50 "
          f"{result['overhead_ms_p50']:.2f} ms, p99 {result['overhead_ms_p99']:.2f} ms; with "
          f"{args.runs} concurrent runs (queueing included): p50 "
          f"{result['overhead_concurrent_ms_p50']:.1f} ms, p99 "
          f"{result['overhead_concurrent_ms_p99']:.1f} ms; throughput endpoint / harness = "
          f"{result['throughput_ratio']:.2f}")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


def harness_path_sync(fmt, args) -> dict:
    return asyncio.run(harness_path(fmt, runs=args.runs, turns=args.turns, seed=args.seed))


if __name__ == "__main__":
    sys.exit(main())
