"""Set-up shared by the pytest-xdist workers of one test run: a run-wide directory and a lock
so that one worker builds an expensive set-up and the others read it."""

from __future__ import annotations

import contextlib
import fcntl
import os
import pathlib


def shared_dir(tmp_path_factory, name: str) -> pathlib.Path:
    """A directory of the whole test run: every pytest-xdist worker's (the workers' base temp
    dirs share a parent), or this process's without workers."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = tmp_path_factory.getbasetemp().parent / name
        shared.mkdir(exist_ok=True)
        return shared
    return tmp_path_factory.mktemp(name)


@contextlib.contextmanager
def run_lock(path: pathlib.Path):
    """Hold an exclusive lock on ``path`` (a file): one builder of a shared set-up among the
    workers; the others wait, then read what it built."""
    with open(path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


SERIAL_MARKERS = ("faults", "multinode", "serial")
"""Markers of the tests ``make test-all`` runs alone, after the others: it passes only the files
whose source names one of them (``grep``), so each such test must be marked in its own file."""


def check_serial_marks_are_in_their_files(items) -> None:
    """Raise ``pytest.UsageError`` naming a test marked with one of :data:`SERIAL_MARKERS` whose
    file does not name that mark (the root conftest calls it on every collection)."""
    import pytest

    texts: dict = {}
    for item in items:
        for name in {m.name for m in item.iter_markers()} & set(SERIAL_MARKERS):
            if item.path not in texts:
                texts[item.path] = item.path.read_text()
            if f"mark.{name}" not in texts[item.path]:
                raise pytest.UsageError(
                    f"{item.nodeid} is marked {name!r} but {item.path.name} does not name "
                    f"pytest.mark.{name}: make test-all's second phase would not collect it")


TRACKER_ENV = ("WANDB_", "MLFLOW_")
"""Environment prefixes the experiment trackers read and write (``WANDB_MODE``, W&B's service
address ``WANDB_SERVICE``, ``MLFLOW_*``): one test's settings must not reach another's, nor the
workers of a Ray cluster it starts later (they inherit the driver's environment)."""


@contextlib.contextmanager
def clean_tracker_env():
    """Run without the trackers' environment variables, and leave none behind: those set inside
    are removed, those there before come back."""
    before = {k: v for k, v in os.environ.items() if k.startswith(TRACKER_ENV)}
    for k in before:
        del os.environ[k]
    try:
        yield
    finally:
        for k in [k for k in os.environ if k.startswith(TRACKER_ENV)]:
            del os.environ[k]
        os.environ.update(before)


def load_script(path: pathlib.Path, name: str, *, register: bool = False):
    """Import the script at ``path`` (a benchmark, a CI helper: not a package module) as module
    ``name``. ``register``: put it in ``sys.modules`` (a dataclass of the script looks its
    module up); not for a script with Ray tasks, which Ray would then pickle by a module name
    its workers cannot import."""
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    if register:
        sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod
