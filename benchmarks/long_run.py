"""The environment side of a model call over runs of 1,000 calls: harness and endpoint.

A run of ``--calls`` tool calls, each answered with a ``--result-chars`` tool result (2,000
characters: a file read, a search page), on the ChatML and Llama-3 templates (``build_tokenizer
(style=...)``). The model's turns are scripted (the template's own rendering of one call), so
what is timed is the environment side only:

- **harness**: the real :class:`~ray_xlong.rollout.Harness` on a scripted engine; a call's cost
  is the time from one ``engine.generate``'s return to the next call of it (parse, record,
  tool, delta, context append);
- **endpoint**: what the OpenAI endpoint does per chat request between the request's JSON and
  the engine (``serving.prompts``: messages normalized against the previous request, the
  prompt built, the turn parsed, the call recorded, the context kept). The request's JSON
  parsing and schema validation are not included: the protocol sends the whole history each
  request, so they are O(history) whatever the endpoint does.

Per template and side: the median cost (process CPU time; wall time in the JSON, which also
counts waiting for a core) of the 20 calls ending at calls 10, 100, 400 and 1,000 (those ≤
``--calls``), the median of ``--repeats`` runs (3: a burst of load on one run moves it less),
the ratio last / call 10 (goal ≤ 2), and, side by side, the exact rule
(the whole conversation rendered each call, ``DeltaChecks(windowed=False)``) up to
``--exact-calls`` calls. ``delta_stats`` are the format's counters (windowed, exact, checked,
mismatches, unproven).

``--train-steps S`` adds one long run end to end on CPU: the ``long_horizon`` task of ``S``
steps solved by its scripted oracle (a subagent every third step) through the harness on the
tiny model's token format, with compaction, processed into its prefix tree (one row), and
trained as one step on 1 and 2 context-parallel Learner ranks (gloo processes,
``LearnerSettings.context_parallel``): calls, tokens, compactions, step times and the largest
logprob and gradient differences of 2 ranks against 1 (JSON ``train``).

    python benchmarks/long_run.py --calls 1000 --json out.json
    python benchmarks/long_run.py --calls 12 --exact-calls 12 --json out.json     # CI smoke
    python benchmarks/long_run.py --calls 0 --train-steps 200 --json out.json      # ≥ 300 calls
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import pathlib
import sys
import time

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # benchmarks.tools
from benchmarks.tools.entry import bench_parser, finish  # noqa: E402

TEMPLATES = ("chatml", "llama3")
POINTS = (10, 100, 400, 1000)
TOOL = {"type": "function", "function": {
    "name": "read", "description": "Read a page.",
    "parameters": {"type": "object", "properties": {"page": {"type": "integer"}},
                   "required": ["page"]}}}


def result_text(k: int, chars: int) -> str:
    """Call ``k``'s tool result: ``chars`` characters of words (deterministic)."""
    words = [f"w{(k * 7919 + i * 104729) % 9973}" for i in range(chars // 3 + 1)]
    return " ".join(words)[:chars]


def make_format(style: str, *, windowed: bool):
    from ray_xlong.models.tokenizer import build_tokenizer
    from ray_xlong.rollout.template_delta import DeltaChecks
    from ray_xlong.rollout.template_format import TemplateFormat

    tok = _tokenizer(style, build_tokenizer)
    return TemplateFormat(tok, delta_checks=DeltaChecks(windowed=windowed), where=style)


_TOKENIZERS: dict = {}


def _tokenizer(style, build):
    if style not in _TOKENIZERS:
        _TOKENIZERS[style] = build(style=style, vocab_size=600)
    return _TOKENIZERS[style]


class _Env:
    """A task whose one tool returns a fixed-size result."""

    def __init__(self, chars: int) -> None:
        from ray_xlong.rollout.tasks.base import Observation

        self.tools, self.chars, self.k = (TOOL,), chars, 0
        self._obs = Observation("You read pages with the tool.", "Read every page.")

    def reset(self):
        return self._obs

    async def call_tool(self, name, args):
        self.k += 1
        return result_text(self.k, self.chars)

    def submit(self, answer):
        pass

    def score(self):
        return 1.0

    def close(self):
        pass


def harness_costs(style: str, calls: int, chars: int, *, windowed: bool) -> tuple[list, dict]:
    """Per call: seconds from the previous engine call's return to this one (harness side)."""
    from ray_xlong.rollout import Harness, HarnessConfig, ScriptedEngine
    from ray_xlong.rollout.chat import ToolCall

    fmt = make_format(style, windowed=windowed)
    turn = fmt.turn_ids(calls=[ToolCall("read", {"page": 1})])
    answer = fmt.turn_ids(text="done")
    state = {"n": 0}

    def policy(ids):
        state["n"] += 1
        return turn if state["n"] <= calls else answer

    marks: list[tuple[tuple, tuple]] = []

    class Timed(ScriptedEngine):
        """The scripted engine, timed from its return to the next call (the harness side;
        the engine's own input check excluded)."""

        back: tuple | None = None

        async def generate(self, input_ids, **kw):
            now = _clocks()
            if self.back is not None:
                marks.append((self.back, now))
            result = await super().generate(input_ids, **kw)
            self.back = _clocks()
            return result

    per_call = len(fmt.encode(result_text(1, chars))) + 64
    capacity = (calls + 2) * per_call + 4096
    cfg = HarnessConfig(max_new_tokens=64, context_capacity=capacity + 4 * chars + 128,
                        compaction_budget=capacity,
                        max_run_tokens=1 << 30, wall_clock_s=1e6, max_calls=calls + 1,
                        max_subagent_depth=0, max_tool_output_tokens=4 * chars)
    engine = Timed(policy, vocab_size=len(fmt.tokenizer))
    result = asyncio.run(Harness(engine, fmt, config=cfg).run(_Env(chars), run_id="r",
                                                             group_id="g"))
    if result.run.status != "finished":
        raise RuntimeError(f"harness run ended {result.run.status}: {result.info}")
    stats = {**dataclasses.asdict(fmt.delta_stats),
             "context_tokens": int(result.run.calls[calls - 1].input_ids.size)}
    return [(b[0] - a[0], b[1] - a[1]) for a, b in marks][:calls], stats


def _clocks() -> tuple[float, float]:
    """(process CPU seconds, wall seconds): CPU time is what the call costs; wall time also
    counts waiting for a core on a loaded machine."""
    return time.process_time(), time.perf_counter()


def endpoint_costs(style: str, calls: int, chars: int, *, windowed: bool) -> tuple[list, dict]:
    """Per call: seconds of the endpoint's work on a chat request (see module docstring)."""
    from ray_xlong.rollout.chat import ToolCall
    from ray_xlong.rollout.engine import GenerateResult
    from ray_xlong.serving import responses
    from ray_xlong.serving.messages import AgentTag
    from ray_xlong.serving.prompts import build_prompt, next_context, normalize_request
    from ray_xlong.serving.runs import RunRegistry

    fmt = make_format(style, windowed=windowed)
    out = fmt.turn_ids(calls=[ToolCall("read", {"page": 1})])
    result = GenerateResult(out, np.full(out.size, -1.0), 0, "stop")
    runs = RunRegistry()
    run, tag, tools = runs.open(group_id="g"), AgentTag("main"), (TOOL,)
    raw = [{"role": "system", "content": "You read pages with the tool."},
           {"role": "user", "content": "Read every page."}]
    costs = []
    for k in range(1, calls + 1):
        t0 = _clocks()
        previous = run.agents.get("main")
        messages = normalize_request(raw, previous)
        prompt = build_prompt(fmt, previous, messages, tools)
        turn = responses.parse_turn(fmt, result, tools=tools)
        runs.record(run, tag, prompt.ids, result, started=time.time())
        run.agents["main"] = next_context(fmt, prompt, messages, turn.normal_form(), tools,
                                          result.output_ids, raw)
        t1 = _clocks()
        costs.append((t1[0] - t0[0], t1[1] - t0[1]))
        call_id = turn.ids[0]                               # the client echoes the turn back
        raw = raw + [{"role": "assistant", "content": None, "tool_calls": [
            {"id": call_id, "type": "function",
             "function": {"name": "read", "arguments": json.dumps({"page": 1})}}]},
            {"role": "tool", "tool_call_id": call_id, "content": result_text(k, chars)}]
        if k > 1 and not prompt.extends:
            raise RuntimeError(f"endpoint call {k} did not extend the previous request")
    return costs, {**dataclasses.asdict(fmt.delta_stats), "context_tokens": int(prompt.ids.size)}


def at_points(costs: list[float]) -> dict[int, float]:
    """Median seconds of the (up to) 20 calls ending at each point (1-based calls)."""
    return {p: float(np.median(costs[max(0, p - 20):p])) for p in POINTS if p <= len(costs)}


def _median_points(runs: list[dict[int, float]]) -> dict[int, float]:
    """Per point, the median over repeated runs (a burst of load on one run moves it less)."""
    return {p: float(np.median([r[p] for r in runs])) for p in runs[0]}


def run(*, calls: int, exact_calls: int, chars: int, repeats: int = 1) -> dict:
    rows = []
    for style in TEMPLATES if calls > 0 else ():
        for side, measure in (("harness", harness_costs), ("endpoint", endpoint_costs)):
            for rule, n in (("windowed", calls), ("exact", min(exact_calls, calls))):
                if n < 1:
                    continue
                reps = [measure(style, n, chars, windowed=rule == "windowed")
                        for _ in range(repeats)]
                stats = reps[-1][1]
                cpu = _median_points([at_points([c for c, _ in r]) for r, _ in reps])
                wall = _median_points([at_points([w for _, w in r]) for r, _ in reps])
                first, last = cpu.get(10), cpu[max(cpu)] if cpu else None
                rows.append({"template": style, "side": side, "rule": rule, "calls": n,
                             "ms_at": {str(p): round(v * 1e3, 3) for p, v in cpu.items()},
                             "wall_ms_at": {str(p): round(v * 1e3, 3) for p, v in wall.items()},
                             "ratio_last_vs_10": round(last / first, 2) if first else None,
                             "mean_ms": round(float(np.mean([c for r, _ in reps
                                                             for c, _ in r])) * 1e3, 3),
                             "repeats": repeats,
                             "delta_stats": stats})
    return {"calls": calls, "result_chars": chars, "repeats": repeats, "rows": rows}


def long_horizon_row(steps: int, *, seed: int, work: str):
    """The long run: (its PackedBatch tree row, facts about the run), model dir in ``work``."""
    from ray_xlong.cells.long_horizon_job import oracle_engine
    from ray_xlong.models import TinyModelConfig, build_tiny_model_dir, load_tokenizer
    from ray_xlong.rollout import Harness, HarnessConfig, load_chat_format
    from ray_xlong.rollout.tasks.long_horizon import LongHorizonConfig, LongHorizonTask
    from ray_xlong.trajectory.batch_config import ProcessorConfig
    from ray_xlong.trajectory.per_run import pack_runs, process_run

    shape = TinyModelConfig(hidden_size=64, num_layers=1, num_heads=1, num_kv_heads=1,
                            intermediate_size=128, max_position_embeddings=1 << 16)
    model_dir = build_tiny_model_dir(pathlib.Path(work) / "model", seed=seed, config=shape)
    chat = load_chat_format(model_dir)
    engine = oracle_engine(str(model_dir), steps, 3, model_logprobs=False)
    task = LongHorizonTask(seed, config=LongHorizonConfig(
        num_steps=steps, latency_median_s=1.0, latency_sigma=0.5, time_scale=1e-6))
    cfg = HarnessConfig(max_new_tokens=32, context_capacity=4096, compaction_budget=2048,
                        max_run_tokens=1 << 30, wall_clock_s=1e6, max_calls=4 * steps + 8)
    start = time.perf_counter()
    result = asyncio.run(Harness(engine, chat, config=cfg).run(task, run_id="long",
                                                              group_id="g"))
    run_s = time.perf_counter() - start
    if result.run.status != "finished":
        raise RuntimeError(f"the long run ended {result.run.status}: {result.info}")
    conf = ProcessorConfig(row_tokens=None, vocab_size=len(load_tokenizer(model_dir)))
    batch = pack_runs([process_run(result.run, conf)], {"long": 1.0}, config=conf)
    facts = {"steps": steps, "calls": len(result.run.calls),
             "compactions": result.info.compactions, "subagents": result.info.subagents,
             "generated_tokens": int(result.run.num_tokens),
             "row_tokens": int(batch.input_ids.shape[1]),
             "targets": int(batch.target_ids.numel()), "harness_s": round(run_s, 2)}
    return batch, facts, str(model_dir)


def _train_rank(rank: int, ranks: int, batch_path: str, model_dir: str, port: int,
                out: str) -> None:
    """One Learner rank: its share of the row, one step's logprobs and gradients, saved."""
    import torch

    from ray_xlong.cells.config import LearnerSettings
    from ray_xlong.cells.context_parallel import rank_share
    from ray_xlong.cells.sharded import LearnerRank, rank_rows
    from ray_xlong.cells.sharding import ShardingSettings
    from ray_xlong.trajectory.loss import policy_loss

    torch.set_num_threads(1)
    learner = LearnerRank(settings=LearnerSettings(model_dir=model_dir, context_parallel=ranks),
                          sharding=ShardingSettings(ranks_per_cell=ranks, timeout_s=3600.0),
                          rank=rank, world_size=ranks)
    learner.setup("127.0.0.1", port)
    batch = torch.load(batch_path, weights_only=False)
    if ranks > 1:
        local, plan, _ = rank_share(batch, rank=rank, world_size=ranks, context_parallel=ranks,
                                    group=learner.cp_group)
        offset = plan.start
    else:
        (local, _), plan, offset = rank_rows(batch, rank=0, world_size=1), None, 0
    start = time.perf_counter()
    logprobs = learner.root(local.to_tensors(), plan)
    loss, _ = policy_loss(logprobs, local)
    loss.backward()
    grads = learner.take_gradients()
    torch.save({"seconds": time.perf_counter() - start, "logprobs": logprobs.detach(),
                "src": local.target_src + offset, "grads": grads}, f"{out}/rank{rank}.pt")


def train_long_run(steps: int, *, seed: int) -> dict:
    """The long run trained on 1 and 2 context-parallel ranks (see module docstring)."""
    import socket
    import tempfile

    import torch
    import torch.multiprocessing as mp

    work = tempfile.mkdtemp(prefix="xlong_long_run_")
    batch, facts, model_dir = long_horizon_row(steps, seed=seed, work=work)
    batch_path = f"{work}/batch.pt"
    torch.save(batch, batch_path)
    got = {}
    for ranks in (1, 2):
        out = tempfile.mkdtemp(dir=work)
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        mp.spawn(_train_rank, args=(ranks, batch_path, model_dir, port, out), nprocs=ranks)
        parts = [torch.load(f"{out}/rank{r}.pt") for r in range(ranks)]
        src = torch.cat([p["src"] for p in parts])
        got[ranks] = {"seconds": max(p["seconds"] for p in parts), "grads": parts[0]["grads"],
                      "logprobs": torch.cat([p["logprobs"] for p in parts])[torch.argsort(src)]}
    one, two = got[1], got[2]
    grad_diff = max(float(((two["grads"][k] - g).abs().max() / g.abs().max().clamp_min(1e-30)))
                    for k, g in one["grads"].items())
    return {**facts, "step_s_1_rank": round(one["seconds"], 2),
            "step_s_2_ranks": round(two["seconds"], 2),
            "max_abs_logprob_diff": float((one["logprobs"] - two["logprobs"]).abs().max()),
            "max_rel_grad_diff": grad_diff}


def show(result: dict) -> None:
    if result.get("train"):
        t = result["train"]
        print(f"long run: {t['steps']} steps, {t['calls']} calls, {t['compactions']} "
              f"compactions, {t['generated_tokens']} generated tokens, tree row "
              f"{t['row_tokens']} tokens, "
              f"{t['targets']} targets; step 1 rank {t['step_s_1_rank']} s, 2 ranks "
              f"{t['step_s_2_ranks']} s; max abs Δ logprob {t['max_abs_logprob_diff']:.2e}, "
              f"max rel Δ grad {t['max_rel_grad_diff']:.2e}")
    if not result["rows"]:
        return
    print(f"environment side per call, CPU ms (median of the 20 calls ending at call N, median "
          f"of {result.get('repeats', 1)} runs; {result['result_chars']}-character tool results;"
          f" wall ms in the JSON)")
    print("| template | side | rule | " + " | ".join(f"call {p}" for p in POINTS)
          + " | last / call 10 | context tokens at the last call | delta stats |")
    print("|---|---|---|" + "---:|" * len(POINTS) + "---:|---:|---|")
    for r in result["rows"]:
        cells = [str(r["ms_at"].get(str(p), "")) for p in POINTS]
        s = r["delta_stats"]
        print(f"| {r['template']} | {r['side']} | {r['rule']} | " + " | ".join(cells)
              + f" | {r['ratio_last_vs_10']} | {s['context_tokens']:,} | windowed {s['windowed']}, "
              f"exact {s['exact']}, mismatches {s['mismatches']}, unproven {s['unproven']} |")


def main(argv=None) -> dict:
    parser = bench_parser(__doc__)
    parser.add_argument("--calls", type=int, default=1000)
    parser.add_argument("--exact-calls", type=int, default=100,
                        help="calls of the exact rule (side by side; O(n^2) per run)")
    parser.add_argument("--result-chars", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=3,
                        help="runs per template, side and rule; each point is their median")
    parser.add_argument("--train-steps", type=int, default=0,
                        help="also one long_horizon run of this many steps, trained on 1 and 2 "
                             "context-parallel ranks (0: not)")
    args = parser.parse_args(argv)
    if args.smoke:
        args.calls, args.exact_calls = min(args.calls, 12), min(args.exact_calls, 12)
        args.repeats = 1
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    result = run(calls=args.calls, exact_calls=args.exact_calls, chars=args.result_chars,
                 repeats=args.repeats)
    if args.train_steps:
        result["train"] = train_long_run(args.train_steps, seed=args.seed)
    return finish(result, show=show, json_path=args.json)


if __name__ == "__main__":
    main()
