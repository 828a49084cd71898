"""The learnable task: look a key up in a hidden table with a tool, then answer its value.

    user:  What is the value of key 3?
    model: lookup({"key": 3})           tool: 47          (the table is only reachable here)
    model: answer 47                    reward 1.0

(in the model's chat format: ``[call] lookup 3 [end]`` in the token format,
``<tool_call>{"name": "lookup", "arguments": {"key": 3}}</tool_call>`` in a ChatML template.)

Reward (``score``, verifiable): 1.0 when the answer is the target key's value; 0.2 when the
target key was looked up but the answer is missing or wrong (partial credit); 0 otherwise.
The table maps every key ``0 .. num_keys-1`` to a two-digit value drawn from the seed, so a call
with a wrong key *succeeds* and returns a wrong value: nothing but the right key in the call
and the returned value in the answer earns the reward, and a blind guess is right with
probability 1/90.

Why it is learnable but not trivial (for a tiny model, warm-started on the format):
:func:`noisy_demonstrations` gives well-formed runs whose lookup key is the prompt's key only at
``right_key_rate`` (otherwise a uniformly drawn other key; the answer is whatever that lookup
returned). A model fitted to them follows the format and answers with the value it got back,
but looks the wrong key up most of the time (mean reward ~0.15-0.4 at temperature 1). RL has to
learn to copy the prompt's key into the call: the one decision that matters, already in the
policy's support, so group-relative advantages point the same way on every instance.
"""

from __future__ import annotations

import numpy as np

from ray_xlong.checks import is_int
from ray_xlong.rollout.chat import ToolCall, demonstration_ids
from ray_xlong.rollout.tasks.base import Observation, ToolError
from ray_xlong.rollout.tool_calls import function_schema

SYSTEM = "Use the lookup tool, then answer."
PARTIAL_CREDIT = 0.2
"""Reward of a run that looked the right key up but answered wrong."""


class LookupTask:
    """One instance (see module docstring)."""

    def __init__(self, seed: int, *, num_keys: int = 10) -> None:
        if not is_int(num_keys) or not 2 <= num_keys <= 10:
            raise ValueError(f"LookupTask.num_keys must be an int in [2, 10], got {num_keys!r}")
        rng = np.random.default_rng(seed)
        self.table = {str(k): str(int(v)) for k, v in
                      enumerate(rng.integers(10, 100, num_keys))}
        self.key = str(int(rng.integers(0, num_keys)))
        self.answer: str | None = None
        self.looked_up_right = False
        self.tools = (function_schema("lookup", "The value of a key in the table.", {
            "key": {"type": "integer", "minimum": 0, "maximum": num_keys - 1}}),)

    @property
    def value(self) -> str:
        """The right answer: the target key's value."""
        return self.table[self.key]

    def reset(self) -> Observation:
        self.answer, self.looked_up_right = None, False
        return Observation(SYSTEM, f"What is the value of key {self.key}?")

    async def call_tool(self, name: str, args: dict) -> str:
        if name != "lookup":
            raise ToolError(f"unknown tool {name!r}; tools: lookup")
        key = str(args.get("key"))
        if key not in self.table:
            raise ToolError(f"lookup: no key {key!r}; keys are 0-{len(self.table) - 1}")
        self.looked_up_right |= key == self.key
        return self.table[key]

    def submit(self, answer: str) -> None:
        self.answer = answer

    def score(self) -> float:
        if self.answer is not None and self.answer.strip() == self.value:
            return 1.0
        return PARTIAL_CREDIT if self.looked_up_right else 0.0

    def close(self) -> None:
        pass


def demonstration(task: LookupTask, chat, *, key: str | None = None
                  ) -> tuple[np.ndarray, np.ndarray]:
    """A well-formed run looking up ``key`` (default: the right one) and answering the value
    that lookup returns, as ``(ids [n], loss_mask [n] bool)`` (mask = the model's turns)."""
    obs = task.reset()
    key = task.key if key is None else key
    value = task.table[key]
    return demonstration_ids(chat, system=obs.system, user=obs.prompt, tools=task.tools,
                             turns=[([ToolCall("lookup", {"key": int(key)})], "", [value]),
                                    ((), value, ())])


def noisy_demonstrations(chat, *, count: int, right_key_rate: float, seed: int,
                         num_keys: int = 10) -> list[tuple[np.ndarray, np.ndarray]]:
    """``count`` demonstrations of fresh instances; each looks up the right key with
    probability ``right_key_rate``, else a uniformly drawn *other* key (seeded)."""
    if not 0.0 <= right_key_rate <= 1.0:
        raise ValueError(f"right_key_rate must be in [0, 1], got {right_key_rate!r}")
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        task = LookupTask(int(rng.integers(2**31)), num_keys=num_keys)
        key = task.key
        if rng.random() >= right_key_rate:
            key = str(int(rng.choice([k for k in range(num_keys) if str(k) != task.key])))
        out.append(demonstration(task, chat, key=key))
    return out
