"""One harness run on the code task with a tiny local model; prints its calls and its tree.

The tiny model is random, so by default a scripted policy (the task's demonstration: write
solution.py, run the tests, answer) drives the run while the tiny model scores every emitted
token (real logprobs); ``--sample`` lets the tiny model itself generate (greedy, HF engine).

    python examples/agent_run.py [--seed 0] [--sample]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ray_xlong.models import build_tiny_model_dir, load_model, load_tokenizer  # noqa: E402
from ray_xlong.rollout import (TokenFormat, HFEngine, Harness, HarnessConfig,  # noqa: E402
                               ScriptedEngine, ToolCall)
from ray_xlong.rollout.tasks import CodeTask  # noqa: E402
from ray_xlong.rollout.tasks.code import demonstration_calls  # noqa: E402
from ray_xlong.trajectory import PrefixTree, assemble, select  # noqa: E402


def demo_policy(chat, task):
    steps = [chat.turn_ids(calls=[ToolCall(name, args)])
             for name, args in demonstration_calls(task)]
    steps.append(chat.turn_ids(text="done"))
    return lambda ids: steps[min(chat.decode(ids).count("<|tool|>"), len(steps) - 1)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sample", action="store_true", help="the tiny model generates")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="xlong_example_") as tmp:
        model_dir = build_tiny_model_dir(os.path.join(tmp, "model"), seed=args.seed)
        chat = TokenFormat(load_tokenizer(model_dir))
        task = CodeTask(args.seed)
        engine = (HFEngine(model_dir, seed=args.seed) if args.sample else
                  ScriptedEngine(demo_policy(chat, task), vocab_size=512,
                                 model=load_model(model_dir)))
        harness = Harness(engine, chat, config=HarnessConfig(
            max_new_tokens=96, temperature=0.0, max_calls=6, max_tool_output_tokens=96))
        try:
            result = asyncio.run(harness.run(task, run_id="example", group_id="g"))
        finally:
            task.close()
    run = result.run
    print(f"{run}\n{result.info}\n")
    for call in run.calls:
        print(f"{call!r}\n  out: {chat.decode(call.output_ids)!r}\n"
              f"  mean logprob {call.output_logprobs.mean():.3f}")
    kept, _ = select(assemble(run), 5)
    tree = PrefixTree.build(run.run_id, kept)
    print("\nprefix tree:")
    print(tree.pretty_print())


if __name__ == "__main__":
    main()
