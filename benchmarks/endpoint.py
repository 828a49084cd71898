"""The endpoint vs the in-process harness on the same concurrent multi-turn tool-calling runs.

What is measured, per engine (``--engines scripted,hf``), side by side in one run:

* **harness** — ``Harness.run_many``: the built-in agent loop, engine calls in-process (this
  process), as a cell's runner runs built-in tasks.
* **endpoint** — the way the product runs an external agent: the endpoint (uvicorn +
  :class:`~ray_xlong.serving.app.Endpoint` on its engine's event loop) runs in **its own
  process** (``--serve``, a child of this one, as on a cell's runner), and ``runs`` concurrent
  agents written against ``openai.AsyncOpenAI`` run in this process and talk HTTP to it. Server
  and clients do not share a GIL.

Engines:

* ``scripted`` — a :class:`ScriptedEngine` policy (ChatML template, Hermes tool calls:
  ``turns`` tool turns, then an answer; engine time ~0): the **pure overhead** of the endpoint.
* ``hf`` — the tiny ChatML model warm-started on the lookup task (what ``examples/
  openai_agent.py`` and the main job train; cached under ``--workdir``) on a real
  :class:`HFEngine`: the harness runs ``LookupTask``, the endpoint runs the example's openai
  agent on the same task instances (sampled at temperature 1, so the two paths make similar,
  not identical, calls): a user's agent on a model whose calls cost ~1-3 ms of engine time
  each, about what the openai client and HTTP cost: **overhead-bound**.
* ``compute`` — the scripted runs again, on a :class:`ScriptedEngine` that scores every output
  with a real model (random weights, ``--compute-model`` width x layers): each call costs a
  forward over its whole context, tens of ms that grow with the run as a real model's prefill
  does: **compute-bound**, where a cell with a real model is.

Every path's engine process runs torch on ``--engine-threads`` threads (default 1, the same on
both paths): the other cores are left to the agents' openai clients, as a cell's CPUs are while
its GPU computes (with torch on every core, the clients preempt its OpenMP workers mid-matmul
and the engine, not the endpoint, slows down). Every path's CPU is measured per batch too (this
process, and the endpoint's process): with the agents' clients on the same cores, ``cpu bound``
is the most the endpoint path's calls/s could reach on this machine's cores if all its CPU ran
in parallel, as a ratio to the harness.

Per-call overhead = client-observed latency of a call − the engine time the endpoint recorded
for it (``ModelCall.end_time − start_time``), split apart per call: **endpoint** = the call's
time on the wire (the HTTP transport under the openai client wrapped: request handed over →
response body read) − engine time: HTTP both ways, JSON, schema validation, message
normalization, the prompt delta, tool-call parsing, the response; **client** = latency − time on
the wire: the ``openai`` client's own work (building and type-transforming the request — it walks
every message of the history each call — and parsing the response), which any server would see.
Measured with one run at a time (``--runs`` runs in turn: the call's own cost) and under the concurrent runs (+ queueing
behind the other runs' requests on the endpoint's one event loop, and behind the other agents'
client work in this one process). Throughput = model calls (and generated tokens) per second
of wall time; the ratio is endpoint ÷ harness. Trajectories per run come from the trajectory
processor on each path's recorded runs. A warm-up run on each path is not counted.

    python benchmarks/endpoint.py [--seed 0] [--runs 16] [--turns 10] [--repeats 3]
                                  [--engines scripted,hf,compute] [--compute-model 256x4]
                                  [--engine-threads 1] [--workdir .cache/ray_xlong]
                                  [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import contextvars
import json
import os
import pathlib
import subprocess
import sys
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples"))
from benchmarks.tools.entry import bench_parser, finish  # noqa: E402

from ray_xlong.rollout.chat import ToolCall  # noqa: E402
from ray_xlong.rollout.tasks.base import Observation  # noqa: E402
from ray_xlong.rollout.tool_calls import function_schema  # noqa: E402

TOOLS = [function_schema("lookup", "The value of a key.", {"key": {"type": "integer"}})]
MAX_TOKENS = 24
"""Tokens per call on the real engine (the example agent's ``max_tokens``)."""
CORES = len(os.sched_getaffinity(0))
"""Cores this process may run on (the benchmark's CPU bound)."""


# -- the scripted workload ------------------------------------------------------------------
def policy(fmt, turns: int):
    """``turns`` lookup calls, then the answer."""
    def step(ids: np.ndarray) -> np.ndarray:
        k = fmt.decode(ids).count("<tool_response>")
        if k >= turns:
            return fmt.turn_ids(text="47")
        return fmt.turn_ids(calls=[ToolCall("lookup", {"key": k})])
    return step


class LookupEnv:
    """The scripted workload's task (the harness side)."""

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


async def scripted_agent(base_url: str, task: dict) -> None:
    """The scripted workload's openai agent: answer every tool call until the model answers."""
    from openai_agent import make_client

    client = make_client(base_url)
    messages = [{"role": "system", "content": "Use the tools."},
                {"role": "user", "content": "What is key 3?"}]
    try:
        while True:
            r = await client.chat.completions.create(model="bench", messages=messages,
                                                     tools=TOOLS, max_tokens=64)
            msg = r.choices[0].message
            messages.append(msg.model_dump(exclude_none=True))
            if not msg.tool_calls:
                return
            messages += [{"role": "tool", "tool_call_id": tc.id,
                          "content": f"lookup = {json.loads(tc.function.arguments)}"}
                         for tc in msg.tool_calls]
    finally:
        await client.close()


_LATENCIES: contextvars.ContextVar[list] = contextvars.ContextVar("latencies")
"""Where the running agent's chat calls are timed (one list per agent task)."""
_WIRE: contextvars.ContextVar[list] = contextvars.ContextVar("wire")
"""The same calls' time on the wire: request handed to the HTTP transport → response body read."""


def time_openai_calls() -> None:
    """Make every ``openai.AsyncOpenAI`` of this process time its ``chat.completions.create``
    calls (request sent → response parsed) into the current agent's ``_LATENCIES`` list and
    their HTTP exchange into ``_WIRE`` (its transport wrapped): the example agent makes its own
    client, unmodified. ``latency − wire`` is the openai client's own work."""
    import httpx
    import openai

    base = openai.AsyncOpenAI
    if getattr(base, "xlong_timed", False):
        return

    class Wire(httpx.AsyncBaseTransport):
        def __init__(self, inner) -> None:
            self.inner = inner

        async def handle_async_request(self, request):
            t = time.perf_counter()
            response = await self.inner.handle_async_request(request)
            if request.url.path.endswith("/chat/completions") and not \
                    response.headers.get("content-type", "").startswith("text/event-stream"):
                await response.aread()
                _WIRE.get().append(time.perf_counter() - t)
            return response

        async def aclose(self) -> None:
            await self.inner.aclose()

    class Timed(base):                                   # type: ignore[misc, valid-type]
        xlong_timed = True

        def __init__(self, **kwargs) -> None:
            super().__init__(**kwargs)
            self._client._transport = Wire(self._client._transport)
            create = self.chat.completions.create

            async def timed(*a, **kw):
                t = time.perf_counter()
                out = await create(*a, **kw)
                _LATENCIES.get().append(time.perf_counter() - t)
                return out
            self.chat.completions.create = timed          # type: ignore[method-assign]
    openai.AsyncOpenAI = Timed


# -- the endpoint process -------------------------------------------------------------------
def serve(kind: str, *, model_dir: str, turns: int, seed: int, batch: int,
          compute_model: str) -> None:
    """``--serve``: host an endpoint on ``kind``'s engine; print its URL; stop at stdin EOF."""
    from ray_xlong.serving.server import start_server

    async def main() -> None:
        endpoint = make_endpoint(kind, model_dir=model_dir, turns=turns, seed=seed,
                                 batch=batch, compute_model=compute_model)
        server = await start_server(endpoint)
        print(f"serving {server.url}", flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
        await server.stop()
        await endpoint.engine.close()
    asyncio.run(main())


def make_endpoint(kind: str, *, model_dir: str, turns: int, seed: int, batch: int,
                  compute_model: str):
    from ray_xlong.serving.app import Endpoint, EndpointConfig
    from ray_xlong.serving.server import build_endpoint

    if kind == "hf":
        return build_endpoint(model_dir, engine="hf", seed=seed, max_batch_size=batch)
    fmt = scripted_format()
    engine = make_engine(kind, fmt=fmt, model_dir=model_dir, turns=turns, seed=seed,
                         batch=batch, compute_model=compute_model)
    return Endpoint(engine, tokenizer=fmt.tokenizer, fmt=fmt,
                    config=EndpointConfig(model_name="bench", max_model_len=16384))


def scripted_format():
    from ray_xlong.models.tokenizer import build_tokenizer
    from ray_xlong.rollout.template_format import TemplateFormat

    return TemplateFormat(build_tokenizer(style="chatml", vocab_size=600))


def make_engine(kind: str, *, fmt, model_dir: str, turns: int, seed: int, batch: int,
                compute_model: str):
    from ray_xlong.rollout import HFEngine, ScriptedEngine

    if kind == "hf":
        return HFEngine(model_dir, max_batch_size=batch, seed=seed)
    model = scoring_model(compute_model, vocab=len(fmt.tokenizer), seed=seed) \
        if kind == "compute" else None
    return ScriptedEngine(policy(fmt, turns), vocab_size=len(fmt.tokenizer), seed=seed,
                          max_batch_size=batch, model=model)


def scoring_model(spec: str, *, vocab: int, seed: int):
    """The ``compute`` engine's model: ``WIDTHxLAYERS`` (head dim 64), random weights."""
    from ray_xlong.models.tiny import TinyModelConfig, tiny_causal_lm

    width, layers = (int(x) for x in spec.lower().split("x"))
    config = TinyModelConfig(vocab_size=-(-vocab // 64) * 64, hidden_size=width,
                             num_layers=layers, num_heads=width // 64,
                             num_kv_heads=max(1, width // 128), intermediate_size=width * 11 // 4)
    return tiny_causal_lm(config, seed=seed).eval()


def cpu_seconds(pid: int | None = None) -> float:
    """CPU time (user + system, every thread) of this process or of ``pid`` (Linux ``/proc``)."""
    if pid is None:
        return time.process_time()
    fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# -- the two paths --------------------------------------------------------------------------
def harness_path(kind: str, *, runs: int, turns: int, seed: int, model_dir: str,
                 repeats: int, compute_model: str) -> dict:
    from ray_xlong.rollout import Harness, HarnessConfig, load_chat_format
    from ray_xlong.rollout.tasks.lookup import LookupTask

    fmt = load_chat_format(model_dir) if kind == "hf" else scripted_format()
    if kind != "hf":
        cfg = HarnessConfig(max_new_tokens=64, max_calls=turns + 4, context_capacity=16384,
                            compaction_budget=12000, max_subagent_depth=0)
        envs = lambda n: [LookupEnv() for _ in range(n)]             # noqa: E731
    else:
        cfg = HarnessConfig(max_new_tokens=MAX_TOKENS, max_calls=4, max_retries=0,
                            max_subagent_depth=0)
        envs = lambda n: [LookupTask(seed + i) for i in range(n)]    # noqa: E731

    async def main() -> tuple[float, list]:
        engine = make_engine(kind, fmt=fmt, model_dir=model_dir, turns=turns, seed=seed,
                             batch=runs, compute_model=compute_model)
        harness = Harness(engine, fmt, config=cfg)
        await harness.run_many(envs(1), run_ids=["warm"], group_ids=["w"])
        walls, cpus, recorded = [], [], []
        for k in range(repeats):
            t0, c0 = time.perf_counter(), cpu_seconds()
            results = await harness.run_many(envs(runs), group_ids=["g"] * runs,
                                              run_ids=[f"h{k}_{i}" for i in range(runs)])
            walls.append(time.perf_counter() - t0)
            cpus.append({"harness": cpu_seconds() - c0})
            recorded += [r.run for r in results]
        await engine.close()
        return walls, cpus, recorded
    walls, cpus, recorded = asyncio.run(main())
    return {"walls_s": walls, "cpu_s": cpus, "runs": recorded}


def endpoint_path(kind: str, *, runs: int, turns: int, seed: int, model_dir: str,
                  repeats: int, compute_model: str) -> dict:
    """``runs`` concurrent openai agents against an endpoint in a child process."""
    import httpx
    import torch

    from ray_xlong.trajectory.recording import read_runs

    proc = subprocess.Popen(
        [sys.executable, __file__, "--serve", kind, "--model-dir", model_dir, "--turns",
         str(turns), "--seed", str(seed), "--runs", str(runs), "--compute-model",
         compute_model, "--engine-threads", str(torch.get_num_threads())],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline().split()
        if line[:1] != ["serving"]:
            raise RuntimeError(f"the endpoint process did not start (exit {proc.wait()})")
        url = line[1]

        import openai_agent

        time_openai_calls()

        async def one(http, run_id: str, latencies: tuple[list, list], i: int) -> None:
            _LATENCIES.set(latencies[0])
            _WIRE.set(latencies[1])
            base = (await http.post(f"{url}/runs", json={"group_id": "g", "run_id": run_id})
                    ).json()["base_url"]
            if kind != "hf":
                await scripted_agent(base, {})
            else:
                await openai_agent.agent(base, openai_agent.make_task(seed + i))

        def batch(ids: list[str]) -> tuple[float, list[tuple[list, list]], dict]:
            lats: list[tuple[list, list]] = [([], []) for _ in ids]

            async def all_agents() -> None:
                # One client opens every run (as a driver keeps one): an httpx client builds a
                # TLS context (~26 ms of CPU, profiled), which is not the endpoint's cost.
                async with httpx.AsyncClient(verify=openai_agent.tls_context()) as http:
                    await asyncio.gather(*(one(http, r, lat, i)
                                           for i, (r, lat) in enumerate(zip(ids, lats))))
            t0, c0, s0 = time.perf_counter(), cpu_seconds(), cpu_seconds(proc.pid)
            asyncio.run(all_agents())
            return time.perf_counter() - t0, lats, {"clients": cpu_seconds() - c0,
                                                    "endpoint": cpu_seconds(proc.pid) - s0}

        def ended(ids: list[str]) -> list:
            tmp, out = pathlib.Path(f"/tmp/xlong_endpoint_bench_{seed}_{proc.pid}.jsonl"), []
            for r in ids:
                tmp.write_text(httpx.post(f"{url}/runs/{r}/end", json={"reward": 1.0}).text)
                out += read_runs(str(tmp))
            tmp.unlink()
            return out

        batch(["warm"])
        ended(["warm"])
        alone_ids = [f"a{i}" for i in range(runs)]
        alone_lats = [batch([r])[1][0] for r in alone_ids]        # one run at a time
        alone = ended(alone_ids)
        walls, cpus, lats, recorded = [], [], [], []
        for k in range(repeats):
            ids = [f"e{k}_{i}" for i in range(runs)]
            wall, lat, cpu = batch(ids)
            walls.append(wall)
            cpus.append(cpu)
            lats += lat
            recorded += ended(ids)
    finally:
        if proc.stdin:
            proc.stdin.close()
        proc.wait(timeout=60)
    return {"walls_s": walls, "cpu_s": cpus, "runs": recorded,
            "overhead": _overhead(recorded, lats),
            "overhead_alone": _overhead(alone, alone_lats)}


def _overhead(recorded: list, latencies: list[tuple[list, list]]) -> dict[str, list[float]]:
    """Per call: ``total`` = client latency − engine time, split into ``endpoint`` (time on
    the wire − engine time: HTTP both ways and the server) and ``client`` (latency − time on
    the wire: the openai client's own work)."""
    out: dict[str, list[float]] = {"total": [], "endpoint": [], "client": []}
    for run, (lats, wire) in zip(recorded, latencies):
        if not len(lats) == len(wire) == len(run.calls):
            raise RuntimeError(f"run {run.run_id}: {len(lats)} timed calls ({len(wire)} on "
                               f"the wire), {len(run.calls)} recorded")
        for c, lat, w in zip(run.calls, lats, wire):
            engine = c.end_time - c.start_time
            out["total"].append(lat - engine)
            out["endpoint"].append(w - engine)
            out["client"].append(lat - w)
    return out


def summarize(path: dict) -> dict:
    """Calls and tokens per second of one repeat's wall: the median repeat's wall against the
    mean calls of a repeat (one repeat's stall, e.g. a scheduler hiccup, does not decide)."""
    from ray_xlong.trajectory import ProcessorConfig, TrajectoryProcessor

    runs, walls = path["runs"], path["walls_s"]
    calls = sum(len(r.calls) for r in runs)
    tokens = sum(int(c.output_ids.size) for r in runs for c in r.calls)
    wall = float(np.median(walls))
    batch = TrajectoryProcessor(ProcessorConfig(pack="none")).process(runs)
    cpu = {part: float(np.mean([c[part] for c in path["cpu_s"]])) for part in path["cpu_s"][0]}
    return {"calls": calls, "output_tokens": tokens, "wall_s": wall, "walls_s": walls,
            "calls_per_s": calls / len(walls) / wall, "tokens_per_s": tokens / len(walls) / wall,
            "trajectories_per_run": len(batch.trajectories) / len(runs),
            "failed": sum(r.status == "failed" for r in runs),
            "cpu_s_per_batch": cpu, "cpu_ms_per_call": sum(cpu.values()) * len(walls) / calls * 1e3}


def measure(kind: str, args, model_dir: str) -> dict:
    common = dict(runs=args.runs, turns=args.turns, seed=args.seed, model_dir=model_dir,
                  repeats=args.repeats, compute_model=args.compute_model)
    h = harness_path(kind, **common)
    e = endpoint_path(kind, **common)
    hs, es = summarize(h), summarize(e)
    def ms(part: str, which: str, q: float) -> float:
        return float(np.percentile(np.asarray(e[which][part]) * 1e3, q))
    return {"harness": hs, "endpoint": es,
            "overhead_ms_p50": ms("total", "overhead_alone", 50),
            "overhead_ms_p99": ms("total", "overhead_alone", 99),
            "overhead_concurrent_ms_p50": ms("total", "overhead", 50),
            "overhead_concurrent_ms_p99": ms("total", "overhead", 99),
            "endpoint_overhead_ms_p50": ms("endpoint", "overhead_alone", 50),
            "endpoint_overhead_ms_p99": ms("endpoint", "overhead_alone", 99),
            "client_ms_p50": ms("client", "overhead_alone", 50),
            "client_ms_p99": ms("client", "overhead_alone", 99),
            "endpoint_overhead_concurrent_ms_p50": ms("endpoint", "overhead", 50),
            "throughput_ratio": es["calls_per_s"] / hs["calls_per_s"],
            # the endpoint path's calls/s if its CPU (clients + endpoint) ran on every core at
            # once, ÷ the harness's measured calls/s: the most this machine allows
            "cpu_bound_ratio": CORES / es["cpu_ms_per_call"] * 1e3 / hs["calls_per_s"],
            "token_throughput_ratio": es["tokens_per_s"] / hs["tokens_per_s"]}


def model_dir_for(args) -> str:
    from ray_xlong.cells.task_job import warm_started_model_dir

    warm = None
    if args.quick_warm:
        from ray_xlong.rollout.lookup_recipe import WarmStartConfig

        warm = WarmStartConfig(clean_steps=5, noisy_steps=2, min_accuracy=0.0)
    return warm_started_model_dir(args.workdir, seed=args.seed, warm=warm, style="chatml_tiny")


def print_table(args, results: dict) -> None:
    print(f"{args.runs} concurrent runs, seed {args.seed}; endpoint in its own process, openai "
          f"clients in this one; scripted and compute: {args.turns} tool turns a run; compute "
          f"model {args.compute_model}\n")
    print("| engine | path | calls | tokens | median wall s | calls/s | tokens/s "
          "| trajectories/run | failed | CPU s a batch | CPU ms a call |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---|---:|")
    for kind, res in results.items():
        for name, row in (("harness (in-process)", res["harness"]),
                          ("endpoint (openai client, HTTP)", res["endpoint"])):
            cpu = " + ".join(f"{v:.2f} {k}" for k, v in row["cpu_s_per_batch"].items())
            print(f"| {kind} | {name} | {row['calls']} | {row['output_tokens']} | "
                  f"{row['wall_s']:.2f} | {row['calls_per_s']:.1f} | {row['tokens_per_s']:.0f} "
                  f"| {row['trajectories_per_run']:.2f} | {row['failed']} | {cpu} | "
                  f"{row['cpu_ms_per_call']:.1f} |")
    print("\n| engine | overhead p50 ms (one run) | p99 | of it endpoint p50 | p99 | of it "
          "openai client p50 | p99 | p50 (concurrent) | p99 | endpoint p50 (concurrent) | "
          f"calls/s ratio | tokens/s ratio | cpu bound ({CORES} cores) |")
    print("|---|" + "---:|" * 12)
    for kind, r in results.items():
        print(f"| {kind} | {r['overhead_ms_p50']:.2f} | {r['overhead_ms_p99']:.2f} | "
              f"{r['endpoint_overhead_ms_p50']:.2f} | {r['endpoint_overhead_ms_p99']:.2f} | "
              f"{r['client_ms_p50']:.2f} | {r['client_ms_p99']:.2f} | "
              f"{r['overhead_concurrent_ms_p50']:.2f} | {r['overhead_concurrent_ms_p99']:.2f} | "
              f"{r['endpoint_overhead_concurrent_ms_p50']:.2f} | "
              f"{r['throughput_ratio']:.2f} | {r['token_throughput_ratio']:.2f} | "
              f"{r['cpu_bound_ratio']:.2f} |")


def main(argv=None) -> int:
    parser = bench_parser(__doc__, smoke=False)
    parser.add_argument("--runs", type=int, default=16, help="concurrent runs per path")
    parser.add_argument("--turns", type=int, default=10, help="tool turns per scripted run")
    parser.add_argument("--repeats", type=int, default=3,
                        help="concurrent batches per path (throughput: the median batch)")
    parser.add_argument("--engines", default="scripted,hf,compute",
                        help="any of scripted, hf, compute (comma-separated)")
    parser.add_argument("--compute-model", default="256x4",
                        help="the compute engine's scoring model, WIDTHxLAYERS")
    parser.add_argument("--engine-threads", type=int, default=1,
                        help="torch threads of each path's engine process (the same on both "
                             "paths; the other cores are the agents' clients', as a cell's "
                             "CPUs are while its GPU computes)")
    parser.add_argument("--workdir", default=".cache/ray_xlong", help="warm-start cache (hf)")
    parser.add_argument("--quick-warm", action="store_true",
                        help="a 7-step warm start (smoke tests: plumbing, not a policy)")
    parser.add_argument("--serve", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(args.engine_threads)
    if args.serve:
        serve(args.serve, model_dir=args.model_dir, turns=args.turns, seed=args.seed,
              batch=args.runs, compute_model=args.compute_model)
        return 0
    kinds = [k for k in args.engines.split(",") if k]
    if not kinds or set(kinds) - {"scripted", "hf", "compute"}:
        parser.error(f"--engines: any of scripted, hf, compute, got {args.engines!r}")
    model_dir = model_dir_for(args) if "hf" in kinds else ""
    results = {kind: measure(kind, args, model_dir) for kind in kinds}
    finish({"seed": args.seed, "runs": args.runs, "turns": args.turns, **results},
           show=lambda _: print_table(args, results), json_path=args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
