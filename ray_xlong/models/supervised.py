"""A short supervised warm start: teach a tiny model a task's format in seconds on CPU.

RL needs a reward signal to climb; a random tiny model never emits a well-formed tool call. A
few hundred AdamW steps of next-token cross-entropy on demonstration sequences, with the loss
only on the model's turns (``loss_mask``), make it follow the format (and often the task).
:func:`teacher_forced` measures what it learned: for every position of a held-out
demonstration's mask, whether the greedy next token is the demonstrated one, and its probability.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np
import torch


def warm_start(model: torch.nn.Module, examples: Sequence[tuple[np.ndarray, np.ndarray]], *,
               steps: int = 100, lr: float = 3e-3, batch_size: int = 8,
               seed: int = 0, optimizer: torch.optim.Optimizer | None = None) -> list[float]:
    """Train ``model`` in place on ``examples`` (``(ids [n], loss_mask [n] bool)`` pairs).

    Args:
        model: an HF causal LM.
        examples: demonstrations; a position's mask marks a token the model should emit.
        steps: optimizer steps.
        lr: AdamW learning rate.
        batch_size: examples per step (drawn with a seeded generator).
        seed: sampling seed.
        optimizer: an optimizer over ``model``'s parameters to continue with (e.g. from an
            earlier phase, so that its moments carry over); None: a fresh AdamW with ``lr``.

    Returns:
        The loss of each step.
    """
    if not examples:
        raise ValueError("warm_start: examples is empty")
    rng = np.random.default_rng(seed)
    opt = optimizer if optimizer is not None else torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    losses = []
    for _ in range(steps):
        pick = rng.integers(0, len(examples), batch_size)
        ids, labels, mask = _batch([examples[i] for i in pick])
        logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1].float()
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                 labels[:, 1:].reshape(-1), ignore_index=-100)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    model.eval()
    return losses


@dataclasses.dataclass(frozen=True, slots=True)
class TeacherForced:
    """The model's next-token predictions on one demonstration's masked positions."""

    hit: np.ndarray
    """``[m]`` bool: the greedy (argmax) token is the demonstrated one."""
    prob: np.ndarray
    """``[m]`` float: probability of the demonstrated token."""


@torch.no_grad()
def teacher_forced(model: torch.nn.Module,
                   examples: Sequence[tuple[np.ndarray, np.ndarray]]) -> list[TeacherForced]:
    """Teacher-forced predictions at the masked positions of each example (one batch).

    Args:
        model: an HF causal LM (evaluated in eval mode; its train/eval mode is restored).
        examples: ``(ids [n], loss_mask [n] bool)`` pairs; position 0 is never a target.

    Returns:
        One :class:`TeacherForced` per example, in order; its arrays follow the mask's
        positions 1.. in order (``m`` = masked positions after the first).
    """
    if not examples:
        raise ValueError("teacher_forced: examples is empty")
    ids, labels, mask = _batch(examples)
    was_training = model.training
    model.eval()
    logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1].float()
    model.train(was_training)
    probs = torch.softmax(logits, dim=-1)
    target = labels[:, 1:]
    out = []
    for row in range(len(examples)):
        pos = (target[row] != -100).nonzero().flatten()
        want = target[row, pos]
        out.append(TeacherForced(
            hit=(logits[row, pos].argmax(-1) == want).numpy(),
            prob=probs[row, pos].gather(-1, want[:, None])[:, 0].numpy().astype(np.float64)))
    return out


def _batch(examples) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ids, labels (-100 off the mask) and attention mask, ``[B, L]`` each."""
    longest = max(ids.size for ids, _ in examples)
    ids = torch.zeros(len(examples), longest, dtype=torch.long)
    labels = torch.full((len(examples), longest), -100, dtype=torch.long)
    mask = torch.zeros(len(examples), longest, dtype=torch.long)
    for row, (x, m) in enumerate(examples):
        ids[row, :x.size] = torch.from_numpy(np.asarray(x, np.int64))
        labels[row, :x.size] = torch.where(torch.from_numpy(np.asarray(m, bool)),
                                           ids[row, :x.size], -100)
        mask[row, :x.size] = 1
    return ids, labels, mask
