"""The rollout fixtures (one tiny model directory per session, its token chat format) for the
single-process RL loop's tests (``benchmarks/tools/local_rl.py`` drives the rollout parts)."""

from tests.rollout.conftest import chat, model_dir  # noqa: F401 (pytest fixtures)
