"""The checked warm start: its scores read the two model turns of a demonstration, a start that
does not take is an error naming the score and steps, and (slow) the recipe gives seed 3 — whose
lr-3e-3 start never learned to copy — a usable policy."""

from __future__ import annotations

import numpy as np
import pytest

from ray_xlong.models import build_tiny_model_dir, load_model, load_tokenizer
from ray_xlong.rollout import TokenFormat
from ray_xlong.rollout.tasks.lookup import LookupTask, demonstration
from ray_xlong.rollout.lookup_recipe import (WarmStartConfig, WarmStartFailed, _segments,
                                          score_format, warm_start_policy)


def test_segments_are_the_call_and_the_answer(chat):
    ids, mask = demonstration(LookupTask(3), chat)
    call, answer = _segments(mask)
    model_ids = ids[1:][mask[1:]]
    # call: [call] l o o k u p <key> [end]; answer: [answer] <value digits> [end]
    assert model_ids[call[0]] == chat.call and model_ids[call[-1]] == chat.end
    assert chat.decode(model_ids[call[-2:-1]]).strip() == LookupTask(3).key
    assert model_ids[answer[0]] == chat.answer and model_ids[answer[-1]] == chat.end
    assert call.size + answer.size == model_ids.size


def test_untrained_model_scores_zero(model_dir, chat):
    score = score_format(load_model(model_dir), chat, count=8, right_key_rate=1.0, seed=0)
    assert score.accuracy == 0.0 and score.answer_accuracy == 0.0
    assert 0.0 <= score.right_key_prob < 0.1            # random weights: ~1 / vocabulary


def test_a_start_that_does_not_take_is_an_error(model_dir, chat):
    model = load_model(model_dir)
    config = WarmStartConfig(clean_steps=1, check_steps=1, max_clean_steps=2, noisy_steps=0,
                             check_demonstrations=4)
    with pytest.raises(WarmStartFailed, match=r"seed 5\): held-out clean accuracy 0.00 < "
                                              r"min_accuracy 0.9 after 2 clean steps"):
        warm_start_policy(model, chat, config, seed=5)


def test_no_check_when_min_accuracy_is_zero(model_dir, chat):
    config = WarmStartConfig(clean_steps=2, noisy_steps=1, min_accuracy=0.0,
                             check_demonstrations=4)
    report = warm_start_policy(load_model(model_dir), chat, config, seed=0)
    assert (report.clean_steps, report.noisy_steps, len(report.losses)) == (2, 1, 3)


@pytest.mark.parametrize("kwargs, field", [
    pytest.param(dict(min_accuracy=1.5), "min_accuracy", id="accuracy>1"),
    pytest.param(dict(noisy_lr=0.0), "noisy_lr", id="lr0"),
    pytest.param(dict(check_steps=0), "check_steps", id="no-steps"),
    pytest.param(dict(clean_steps=300, max_clean_steps=200), "max_clean_steps", id="cap<start"),
])
def test_config_names_the_bad_field(kwargs, field):
    with pytest.raises(ValueError, match=f"WarmStartConfig.{field}"):
        WarmStartConfig(**kwargs)


@pytest.mark.slow
def test_recipe_gives_seed_3_a_usable_start(tmp_path):
    """Seed 3 (lr 3e-3: key and value copies at chance, reward 0.00) now copies the value
    every time and looks the right key up at a rate RL can raise (measured: 0.38)."""
    model_dir = build_tiny_model_dir(tmp_path / "s3", seed=3)
    chat = TokenFormat(load_tokenizer(model_dir))
    report = warm_start_policy(load_model(model_dir), chat, WarmStartConfig(), seed=3)
    assert report.clean.accuracy >= 0.9 and report.final_noisy.answer_accuracy >= 0.9
    assert 0.15 <= report.final_clean.right_key_prob <= 0.7
    assert np.isfinite(report.losses).all()
