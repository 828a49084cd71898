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
