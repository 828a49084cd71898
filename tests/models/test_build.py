"""Tiny model directories: deterministic per seed, tokenizer specials, HF loads what was saved."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ray_xlong.models import (SPECIAL_TOKENS, TinyModelConfig, build_tiny_model_dir,
                              build_tokenizer, load_model, load_tokenizer, teacher_forced,
                              warm_start)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    base = tmp_path_factory.mktemp("models")
    return (build_tiny_model_dir(base / "a", seed=3), build_tiny_model_dir(base / "b", seed=3),
            build_tiny_model_dir(base / "c", seed=4, arch="llama"))


def test_same_seed_gives_identical_files(dirs):
    a, b, _ = dirs
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


def test_other_seed_and_arch_differ(dirs):
    a, _, c = dirs
    assert load_model(c).config.model_type == "llama"
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()


def test_tokenizer_specials_and_exact_round_trip(dirs):
    tok = load_tokenizer(dirs[0])
    for i, special in enumerate(SPECIAL_TOKENS):
        assert tok.convert_tokens_to_ids(special) == i
    code = "def add(a, b):\n    return a + b\n\t# ünïcode ✓"
    assert tok.decode(tok.encode(code, add_special_tokens=False)) == code


def test_model_covers_vocabulary_and_special_ids(dirs):
    tok, model = load_tokenizer(dirs[0]), load_model(dirs[0])
    assert model.config.vocab_size >= len(tok) and model.config.vocab_size % 64 == 0
    assert model.config.eos_token_id == tok.eos_token_id
    assert model.config.head_dim == 64


def test_saved_weights_equal_tiny_causal_lm_with_same_seed(dirs):
    from ray_xlong.models import tiny_causal_lm

    model = load_model(dirs[0])
    ref = tiny_causal_lm(TinyModelConfig(vocab_size=model.config.vocab_size), seed=3)
    for (name, p), q in zip(model.state_dict().items(), ref.state_dict().values()):
        assert torch.equal(p, q), name


def test_bad_tokenizer_vocab_names_the_argument():
    with pytest.raises(ValueError, match="vocab_size"):
        build_tokenizer(vocab_size=10)


@pytest.mark.slow
def test_warm_start_lowers_the_loss(dirs):
    model = load_model(dirs[0])
    ids = np.arange(20, 60)
    losses = warm_start(model, [(ids, np.ones(ids.size, bool))], steps=15, lr=1e-2,
                        batch_size=2)
    assert losses[-1] < losses[0] / 2


@pytest.mark.slow
def test_teacher_forced_scores_the_masked_positions(dirs):
    model = load_model(dirs[0])
    ids = np.arange(20, 40)
    mask = np.zeros(ids.size, bool)
    mask[10:15] = True                                   # 5 targets: ids 30 .. 34
    before = teacher_forced(model, [(ids, mask)])[0]
    assert before.hit.shape == before.prob.shape == (5,)
    warm_start(model, [(ids, mask)], steps=30, lr=1e-2, batch_size=1)
    after = teacher_forced(model, [(ids, mask)])[0]
    assert after.hit.all() and after.prob.min() > before.prob.max()
    assert not model.training                            # eval mode kept
