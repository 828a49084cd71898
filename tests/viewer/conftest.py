"""The tiny model directory and chat format the rollout tests use."""

from tests.rollout.conftest import chat, model_dir  # noqa: F401
