"""A learnable multi-turn task: add two numbers with a tool, then answer (verifiable reward).

    user:  What is 3 plus 4?
    model: add({"a": 3, "b": 4})      tool: 7
    model: answer 7                    reward 1.0

Reward (``score``): 1.0 for the right answer; 0.2 when the answer is missing or wrong but the
``add`` tool was called with the right operands (partial credit, so a tiny warm-started model
has a gradient to climb); 0 otherwise. Operands are digits drawn from the seed.
:func:`demonstration` gives the ideal run's ids with a loss mask for a supervised warm start.
"""

from __future__ import annotations

import numpy as np

from ray_xlong.rollout.chat import ToolCall, demonstration_ids
from ray_xlong.rollout.tasks.base import Observation, ToolError
from ray_xlong.rollout.tool_calls import function_schema

SYSTEM = "Use the add tool, then answer."


class ArithmeticTask:
    """One instance (see module docstring)."""

    tools = (function_schema("add", "The sum of two integers.",
                             {"a": {"type": "integer"}, "b": {"type": "integer"}}),)

    def __init__(self, seed: int) -> None:
        rng = np.random.default_rng(seed)
        self.a, self.b = (int(x) for x in rng.integers(0, 10, 2))
        self.answer: str | None = None
        self.called_right = False

    def reset(self) -> Observation:
        self.answer, self.called_right = None, False
        return Observation(SYSTEM, f"What is {self.a} plus {self.b}?")

    async def call_tool(self, name: str, args: dict) -> str:
        if name != "add":
            raise ToolError(f"unknown tool {name!r}; tools: add")
        try:
            x, y = int(args["a"]), int(args["b"])
        except (KeyError, TypeError, ValueError):
            raise ToolError(f"add takes two integers a and b, got {args!r}") from None
        self.called_right |= {x, y} == {self.a, self.b} and x + y == self.a + self.b
        return str(x + y)

    def submit(self, answer: str) -> None:
        self.answer = answer

    def score(self) -> float:
        if self.answer is not None and self.answer.strip() == str(self.a + self.b):
            return 1.0
        return 0.2 if self.called_right else 0.0

    def close(self) -> None:
        pass


def demonstration(task: ArithmeticTask, chat) -> tuple[np.ndarray, np.ndarray]:
    """The ideal run as one sequence: ``(ids [n], loss_mask [n] bool)`` (mask = model turns)."""
    obs = task.reset()
    total = task.a + task.b
    return demonstration_ids(chat, system=obs.system, user=obs.prompt, tools=task.tools,
                             turns=[([ToolCall("add", {"a": task.a, "b": task.b})], "",
                                     [str(total)]), ((), str(total), ())])
