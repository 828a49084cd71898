"""Fixtures every test folder shares, built once per test run.

``warm_cache``: one model cache for the whole run. Warm-started tiny policies are built once per
(seed, warm-start config, chat style) under it (``cells.task_job.warm_started_model_dir`` reuses
a finished one), so the examples, benchmark smoke runs and learning tests that start from the
same policy — in this process or in a subprocess given ``--workdir`` — pay for one warm start.
"""

from __future__ import annotations

import pathlib

import pytest


@pytest.fixture(scope="session")
def warm_cache(tmp_path_factory) -> pathlib.Path:
    """A directory for warm-started policies, shared by every test of the run."""
    return tmp_path_factory.mktemp("warm_cache")
