"""Fixtures every test folder shares, built once per test run.

``warm_cache``: one model cache for the whole run (or for the runs sharing ``RX_TEST_CACHE``).
Warm-started tiny policies are built once per (seed, warm-start config, chat style) under it
(``cells.task_job.warm_started_model_dir`` reuses a finished one, and builds each under a file
lock), so the examples, benchmark smoke runs and learning tests that start from the same policy
— in this process, in another pytest-xdist worker, or in a subprocess given ``--workdir`` — pay
for one warm start.

Under pytest-xdist (``make test-all`` runs the suite on 2 workers) each worker gets its own
``RAY_TMPDIR``: ``ray.init()`` without an address joins the cluster recorded in its temp dir,
which would otherwise be another worker's ``cluster_utils`` cluster.

Every Ray a test starts (its own ``ray.init``, a ``cluster_utils`` cluster, a subprocess's)
keeps its idle task workers (``RAY_num_workers_soft_limit``), as the package's embedded Ray does
(``cells.ray_edge.KEEP_TASK_WORKERS``): on a few logical CPUs Ray would otherwise start a fresh
worker for every join and gradient-sum task.

``RAY_RUNTIME_ENV_HOOK=ray_xlong.zygote.hook make test-all`` forks every such Ray's workers from
one pre-imported interpreter (``ray_xlong.zygote``). It is not on by default: in a clean-clone
run of the whole suite it did not shorten the first phase (``docs/benchmarks.md``).
"""

from __future__ import annotations

import json
import os
import pathlib

import pytest

from tests.shared import check_serial_marks_are_in_their_files, clean_tracker_env, shared_dir

os.environ.setdefault("RAY_num_workers_soft_limit", "64")
_WORKER = os.environ.get("PYTEST_XDIST_WORKER")
if _WORKER:
    os.environ["RAY_TMPDIR"] = f"{os.environ.get('RAY_TMPDIR', '/tmp/ray')}_{_WORKER}"


@pytest.fixture(scope="session")
def warm_cache(tmp_path_factory) -> pathlib.Path:
    """A directory for warm-started policies, shared by every test of the run, or of the runs
    that share ``RX_TEST_CACHE`` (``make test-all``'s two phases: the second one's chaos run
    starts from the policy the first one warm-started)."""
    if os.environ.get("RX_TEST_CACHE"):
        shared = pathlib.Path(os.environ["RX_TEST_CACHE"]) / "warm_cache"
        shared.mkdir(parents=True, exist_ok=True)
        return shared
    return shared_dir(tmp_path_factory, "warm_cache")


DURATIONS = pathlib.Path(__file__).parent / "tests" / "durations.json"
"""Seconds each test file took in the last measured full run (``tests/durations.py`` writes it
from a run's JUnit XML): the order in which pytest-xdist hands out whole files."""


def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist, the longest files go first (each worker takes whole files, so a long
    file handed out last leaves the other worker idle at the end: longest first keeps the
    workers' ends close); each file's tests keep their order. A file :data:`DURATIONS` does not
    list counts 30 s per slow test and 0.5 s per other one. A run without workers keeps pytest's
    order. Every run checks that a test marked with one of ``tests.shared.SERIAL_MARKERS`` is
    marked in its own file."""
    check_serial_marks_are_in_their_files(items)
    if not _WORKER:
        return
    measured = json.loads(DURATIONS.read_text()) if DURATIONS.exists() else {}
    estimate: dict = {}
    for item in items:
        slow = item.get_closest_marker("slow") is not None
        estimate[item.path] = estimate.get(item.path, 0.0) + (30.0 if slow else 0.5)
    weight = {}
    for path, guess in estimate.items():
        rel = path.relative_to(config.rootpath).as_posix()
        weight[path] = float(measured.get(rel, guess))
    first = {}
    for i, item in enumerate(items):
        first.setdefault(item.path, i)
    items.sort(key=lambda it: (-weight[it.path], first[it.path]))


@pytest.fixture(autouse=True)
def _no_tracker_env_between_tests():
    """Each test starts without the experiment trackers' environment variables and leaves
    none behind (``tests.shared.clean_tracker_env``)."""
    with clean_tracker_env():
        yield
