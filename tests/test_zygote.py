"""``ray_xlong.zygote``: Ray workers forked from one pre-imported interpreter.

Without Ray: the client Ray would start runs a script as the zygote's fork, ends the way the
fork ends (exit code, signal), passes a signal on, and its fork dies with it. With Ray: the
first worker of an environment starts the zygote and starts the ordinary way; later ones, of
this Ray and of the next, are its children, with their own raylet, environment, torch threads
(Ray's OMP_NUM_THREADS for the actor's CPUs) and random state; a worker killed by pid, or by
``ray.kill``, is gone like an ordinary one."""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import tempfile
import time

import pytest

from ray_xlong import zygote

WORKER = """
import os, signal, sys, time
print(os.getpid(), os.getppid(), os.environ.get("PYTEST_ZYGOTE_MARK"), flush=True)
mode = sys.argv[1]
if mode == "exit":
    sys.exit(int(sys.argv[2]))
if mode == "kill":
    os.kill(os.getpid(), signal.SIGKILL)
time.sleep(120)
"""


def _cmdline(pid: int) -> str:
    return pathlib.Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()


def _wait(cond, timeout=180.0):
    end = time.time() + timeout
    while not cond():
        assert time.time() < end, "timed out"
        time.sleep(0.2)


def _gone(pid: int) -> bool:
    return not os.path.exists(f"/proc/{pid}")


def test_the_hook_adds_the_client_and_keeps_the_users_runtime_env():
    env = zygote.hook({"env_vars": {"A": "1"}})
    assert env["env_vars"] == {"A": "1"}
    assert env["py_executable"].split()[-1] == zygote.__file__
    assert zygote.hook({"py_executable": "mine"})["py_executable"] == "mine"
    assert zygote.hook(None)["py_executable"] == env["py_executable"]


@pytest.fixture
def served(monkeypatch, tmp_path):
    """A zygote of this test's own environment (nothing preloaded), serving; stopped after."""
    monkeypatch.setenv("RX_ZYGOTE_PRELOAD", "json")
    monkeypatch.setenv("RX_ZYGOTE_TEST", str(tmp_path))
    monkeypatch.delenv("RX_ZYGOTE", raising=False)
    path = zygote.socket_path()
    script = tmp_path / "worker.py"
    script.write_text(WORKER)

    def run(*args, mark="x"):       # PYTEST_*: not part of the key, so the same zygote
        return subprocess.Popen([sys.executable, zygote.__file__, str(script), *args],
                                stdout=subprocess.PIPE, text=True,
                                env=dict(os.environ, PYTEST_ZYGOTE_MARK=mark))

    first = run("exit", "0")                     # starts the zygote, runs the ordinary way
    pid = int(first.stdout.readline().split()[0])
    assert first.wait(30) == 0 and pid == first.pid      # exec'd: the client itself
    _wait(lambda: os.path.exists(path))
    yield run, path
    for line in pathlib.Path(path + ".log").read_text().splitlines():
        if "serving" in line:
            os.kill(int(line.split()[1].rstrip(":")), signal.SIGTERM)
    _wait(lambda: not os.path.exists(path), timeout=30)


def test_the_client_runs_its_script_as_the_zygotes_fork_and_ends_as_it_ends(served):
    run, path = served
    proc = run("exit", "3", mark="own")
    _, ppid, mark = proc.stdout.readline().split()
    assert f"zygote_server.py {path}" in _cmdline(int(ppid))
    assert mark == "own"                                   # its own environment
    assert proc.wait(30) == 3
    proc = run("kill")
    proc.stdout.readline()
    assert proc.wait(30) == -signal.SIGKILL


def test_a_signal_reaches_the_fork_and_the_fork_dies_with_its_client(served):
    run, _ = served
    proc = run("sleep")
    pid = int(proc.stdout.readline().split()[0])
    proc.send_signal(signal.SIGTERM)                    # forwarded: the fork ends by it
    assert proc.wait(30) == -signal.SIGTERM
    _wait(lambda: _gone(pid), timeout=30)
    proc = run("sleep")
    pid = int(proc.stdout.readline().split()[0])
    proc.kill()                                         # SIGKILL: nothing to forward
    proc.wait(30)
    _wait(lambda: _gone(pid), timeout=30)               # the zygote saw the client go


@pytest.mark.ray
@pytest.mark.slow
def test_ray_workers_fork_from_the_zygote_across_ray_sessions(monkeypatch, tmp_path):
    ray = pytest.importorskip("ray")

    @ray.remote(num_cpus=0)
    class Probe:
        def socket_path(self):
            return zygote.socket_path()

        def info(self):
            import numpy as np
            import torch

            return {"pid": os.getpid(), "ppid": os.getppid(), "threads": torch.get_num_threads(),
                    "raylet": int(os.environ["RAY_RAYLET_PID"]), "rand": float(np.random.rand())}

    if ray.is_initialized():
        ray.shutdown()
    # a zygote of its own for this test (the key holds the preload list and the environment)
    monkeypatch.setenv("RX_ZYGOTE_PRELOAD", "numpy,torch")
    monkeypatch.setenv("RX_ZYGOTE_TEST", str(tmp_path))
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)     # Ray sets it per actor
    monkeypatch.delenv("RX_ZYGOTE", raising=False)
    monkeypatch.setenv("RAY_RUNTIME_ENV_HOOK", "ray_xlong.zygote.hook")
    path, zygote_pid = None, None
    try:
        for _ in range(2):
            monkeypatch.setenv("RAY_TMPDIR", tempfile.mkdtemp(prefix="rx", dir="/tmp"))
            ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
            try:
                node = ray._private.worker._global_node
                raylet = node.all_processes["raylet"][0].process.pid
                if zygote_pid is None:    # the first worker starts it and starts plainly
                    first = Probe.remote()
                    assert ray.get(first.info.remote())["ppid"] == raylet
                    path = ray.get(first.socket_path.remote())
                    _wait(lambda p=path: os.path.exists(p))
                probes = [Probe.options(num_cpus=c).remote() for c in (1, 2)]
                infos = ray.get([p.info.remote() for p in probes])
                ppids = {i["ppid"] for i in infos}
                assert len(ppids) == 1, infos
                (ppid,) = ppids
                assert f"zygote_server.py {path}" in _cmdline(ppid)
                zygote_pid = zygote_pid or ppid
                assert ppid == zygote_pid                  # one zygote for both sessions
                assert [i["raylet"] for i in infos] == [raylet, raylet]     # this session's
                assert [i["threads"] for i in infos] == [1, 2]              # the actor's CPUs
                assert infos[0]["rand"] != infos[1]["rand"]     # NumPy re-seeded per child
                os.kill(infos[0]["pid"], signal.SIGKILL)
                with pytest.raises(ray.exceptions.RayActorError):
                    ray.get(probes[0].info.remote())
                ray.kill(probes[1])
                _wait(lambda gone=infos[1]["pid"]: _gone(gone), timeout=60)
            finally:
                ray.shutdown()
    finally:
        if zygote_pid:
            os.kill(zygote_pid, signal.SIGTERM)
