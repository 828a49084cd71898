"""Shared fixtures: one tiny model directory (seeded, built locally) per test session."""

from __future__ import annotations

import pytest

from ray_xlong.models import build_tiny_model_dir, load_tokenizer
from ray_xlong.rollout import TokenFormat


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    return build_tiny_model_dir(tmp_path_factory.mktemp("tiny") / "model", seed=0)


@pytest.fixture(scope="session")
def chat(model_dir):
    return TokenFormat(load_tokenizer(model_dir))
