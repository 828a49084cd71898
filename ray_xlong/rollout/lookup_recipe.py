"""The lookup recipe's supervised warm start, checked: the policy RL starts from must follow the
format and copy what it reads, or RL has no reward to climb.

    clean phase   AdamW on demonstrations that always look up the right key: clean_steps,
                  then check_steps more at a time until the held-out clean accuracy reaches
                  min_accuracy (at most max_clean_steps, else WarmStartFailed)
    noisy phase   noisy_steps on demonstrations that look up the right key only at
                  right_key_rate, at noisy_lr (the same optimizer: its moments carry over)
    check         held-out answer accuracy on noisy demonstrations >= min_accuracy

A held-out demonstration is scored teacher-forced (greedy next token at each model token); the
model's tokens form two segments::

    [call] lo oku p Ġ3 [end]   [tool] 47 [end] [assistant]   [answer] 4 7 [end]
    └──────── call ───────┘                                  └──── answer ────┘
                ▲ key: the call's last number token (before [end]; in a ChatML template's
                  JSON call ``<tool_call>{"name": "lookup", "arguments": {"key": 3}}…`` the Ġ3)

    clean accuracy   share of clean demos with every call and answer token right (the key is
                     copied from the prompt, the value from the tool result)
    answer accuracy  share of noisy demos whose answer is all right (the looked-up value is
                     copied, whichever key was looked up: RL can only reward the right key if
                     the answer follows the lookup)
    right_key_prob   mean probability of the right key token on clean demos (≈ the policy's
                     right-key rate at temperature 1, what RL raises)

Why (measured on seed 3): at lr 3e-3 the model learned the format but never learned to copy (key
and value tokens at chance after 400 clean steps, loss flat at ~0.7; greedy reward 0.00); at
lr 1e-3 both copies were exact after 120 steps. The recipe's lr is now 1e-3, and the check turns
a start that did not take into more steps or a clear error instead of a flat learning curve.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from ray_xlong.checks import check_int, is_int
from ray_xlong.models import teacher_forced, warm_start
from ray_xlong.rollout.chat import ChatFormat
from ray_xlong.rollout.tasks.lookup import noisy_demonstrations

HELD_OUT_SEED = 7_919
"""Offset of the held-out demonstrations' seed (training phases draw ``2 seed + phase``)."""


@dataclasses.dataclass(frozen=True, slots=True)
class WarmStartConfig:
    """The supervised warm start on the lookup task's format (see ``tasks/lookup.py``)."""

    clean_steps: int = 200
    """AdamW steps on demonstrations that always look up the right key (before the check)."""
    noisy_steps: int = 60
    """Then steps on demonstrations that look up the right key only at ``right_key_rate``."""
    right_key_rate: float = 0.4
    """Share of noisy demonstrations with the right key (the rest: another key)."""
    lr: float = 1e-3
    """Learning rate of the clean phase (3e-3 left seed 3 unable to copy; module doc)."""
    noisy_lr: float = 3e-4
    """Learning rate of the noisy phase (1e-3 overshoots: right-key probability ~0.12 after
    10-30 steps before it settles)."""
    batch_size: int = 16
    """Demonstrations per step."""
    demonstrations: int = 2000
    """Demonstrations drawn per phase."""
    min_accuracy: float = 0.9
    """Held-out clean / answer accuracy the start must reach (0: no check, e.g. smoke runs)."""
    check_steps: int = 50
    """Clean steps added per failed check."""
    max_clean_steps: int = 1000
    """Most clean steps before :class:`WarmStartFailed`."""
    check_demonstrations: int = 64
    """Held-out demonstrations per check."""

    def __post_init__(self) -> None:
        for name in ("clean_steps", "noisy_steps"):
            check_int("WarmStartConfig", name, getattr(self, name), minimum=0)
        for name in ("batch_size", "demonstrations", "check_steps", "check_demonstrations"):
            check_int("WarmStartConfig", name, getattr(self, name), minimum=1)
        if not 0.0 <= self.right_key_rate <= 1.0:
            raise ValueError(f"WarmStartConfig.right_key_rate must be in [0, 1], "
                             f"got {self.right_key_rate!r}")
        for name in ("lr", "noisy_lr"):
            if not getattr(self, name) > 0:
                raise ValueError(f"WarmStartConfig.{name} must be > 0, "
                                 f"got {getattr(self, name)!r}")
        if not 0.0 <= self.min_accuracy <= 1.0:
            raise ValueError(f"WarmStartConfig.min_accuracy must be in [0, 1], "
                             f"got {self.min_accuracy!r}")
        if not is_int(self.max_clean_steps) or self.max_clean_steps < self.clean_steps:
            raise ValueError(f"WarmStartConfig.max_clean_steps must be an int >= clean_steps "
                             f"({self.clean_steps}), got {self.max_clean_steps!r}")


@dataclasses.dataclass(frozen=True, slots=True)
class FormatScore:
    """Teacher-forced score of a model on held-out demonstrations."""

    accuracy: float
    """Share of demonstrations with every call and answer token greedy-right."""
    answer_accuracy: float
    """Share of demonstrations with every answer token greedy-right."""
    right_key_prob: float
    """Mean probability of the demonstrated key token."""


@dataclasses.dataclass(frozen=True, slots=True)
class WarmStartReport:
    """What a warm start did (written next to the model by ``task_job``)."""

    clean_steps: int
    """Clean steps taken (``clean_steps`` plus the steps the check added)."""
    noisy_steps: int
    """Noisy steps taken."""
    clean: FormatScore
    """Score on held-out clean demonstrations after the clean phase."""
    final_clean: FormatScore
    """Score on held-out clean demonstrations at the end (its right_key_prob: the start's
    right-key rate)."""
    final_noisy: FormatScore
    """Score on held-out noisy demonstrations at the end (its answer_accuracy is checked)."""
    losses: tuple[float, ...]
    """Loss of every step (both phases)."""


class WarmStartFailed(RuntimeError):
    """The warm start did not reach ``min_accuracy`` (the message names the score and steps)."""


def score_format(model: torch.nn.Module, chat: ChatFormat, *, count: int, right_key_rate: float,
                 seed: int) -> FormatScore:
    """Teacher-forced :class:`FormatScore` on ``count`` fresh lookup demonstrations."""
    demos = noisy_demonstrations(chat, count=count, right_key_rate=right_key_rate, seed=seed)
    full, answer, key_prob = [], [], []
    for (ids, mask), tf in zip(demos, teacher_forced(model, demos)):
        call, ans = _segments(mask)
        full.append(bool(tf.hit.all()))
        answer.append(bool(tf.hit[ans].all()))
        key_prob.append(float(tf.prob[call[_key_index(chat, ids, mask, call)]]))
    return FormatScore(float(np.mean(full)), float(np.mean(answer)), float(np.mean(key_prob)))


def _key_index(chat: ChatFormat, ids: np.ndarray, mask: np.ndarray, call: np.ndarray) -> int:
    """Index into ``call`` of the key token: the call's last token that is a number (``Ġ3``
    before ``[end]`` in the token format; ``Ġ3`` before ``}}`` in a JSON tool call)."""
    positions = np.flatnonzero(np.asarray(mask, bool)[1:]) + 1
    digits = [i for i, t in enumerate(ids[positions[call]])
              if chat.decode(np.asarray([t])).strip().isdigit()]
    if not digits:
        raise ValueError("warm start: a lookup demonstration's call holds no key token")
    return digits[-1]


def _segments(mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Indices (into the masked positions after position 0) of the call and the answer."""
    positions = np.flatnonzero(np.asarray(mask, bool)[1:]) + 1
    runs = np.split(np.arange(positions.size), np.flatnonzero(np.diff(positions) > 1) + 1)
    if len(runs) != 2:
        raise ValueError(f"warm start: a lookup demonstration has 2 model turns, got {len(runs)}")
    return runs[0], runs[1]


def format_corpus(style: str, *, count: int = 32, seed: int = 0) -> list[str]:
    """Rendered lookup demonstrations in tokenizer style ``style`` (extra tokenizer training
    text, so that the template's and the tool calls' text gets short tokens); [] for ``token``."""
    if style == "token":
        return []
    from ray_xlong.models.tokenizer import build_tokenizer
    from ray_xlong.rollout.template_format import TemplateFormat

    fmt = TemplateFormat(build_tokenizer(style=style))
    demos = noisy_demonstrations(fmt, count=count, right_key_rate=0.5, seed=seed)
    return [fmt.decode(ids) for ids, _ in demos]


def warm_start_policy(model: torch.nn.Module, chat: ChatFormat, config: WarmStartConfig, *,
                      seed: int) -> WarmStartReport:
    """Clean phase until the check passes, then the noisy phase (see the module doc).

    Raises:
        WarmStartFailed: the clean accuracy stays under ``min_accuracy`` after
            ``max_clean_steps``, or the answer accuracy falls under it in the noisy phase.
    """
    opt = torch.optim.AdamW(model.parameters(), lr=config.lr)

    def train(rate: float, steps: int, phase: int, chunk: int) -> list[float]:
        demos = noisy_demonstrations(chat, count=config.demonstrations, right_key_rate=rate,
                                     seed=seed * 2 + phase)
        return warm_start(model, demos, steps=steps, optimizer=opt,
                          batch_size=config.batch_size,
                          seed=seed * 2 + phase + 1_000 * chunk) if steps else []

    def score(rate: float) -> FormatScore:
        return score_format(model, chat, count=config.check_demonstrations, right_key_rate=rate,
                            seed=HELD_OUT_SEED + seed)

    losses, taken = train(1.0, config.clean_steps, 0, 0), config.clean_steps
    clean = score(1.0)
    while config.min_accuracy and clean.accuracy < config.min_accuracy:
        if taken >= config.max_clean_steps:
            raise WarmStartFailed(
                f"warm start (seed {seed}): held-out clean accuracy {clean.accuracy:.2f} < "
                f"min_accuracy {config.min_accuracy} after {taken} clean steps "
                f"(max_clean_steps); try a lower WarmStartConfig.lr than {config.lr}")
        step = min(config.check_steps, config.max_clean_steps - taken)
        losses += train(1.0, step, 0, taken)
        taken += step
        clean = score(1.0)
    for group in opt.param_groups:
        group["lr"] = config.noisy_lr
    losses += train(config.right_key_rate, config.noisy_steps, 1, 0)
    report = WarmStartReport(taken, config.noisy_steps, clean, score(1.0),
                             score(config.right_key_rate), tuple(losses))
    if config.min_accuracy and report.final_noisy.answer_accuracy < config.min_accuracy:
        raise WarmStartFailed(
            f"warm start (seed {seed}): held-out answer accuracy "
            f"{report.final_noisy.answer_accuracy:.2f} < min_accuracy {config.min_accuracy} "
            f"after {config.noisy_steps} noisy steps")
    return report
