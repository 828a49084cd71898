"""``ray_xlong.zygote``: Ray workers forked from one pre-imported interpreter. The first worker
of an environment starts the zygote and starts the ordinary way; later ones, of this Ray and of
the next, are its children, with their own raylet, environment, torch threads and random state;
a worker killed by pid, or by ``ray.kill``, is gone like an ordinary one."""

from __future__ import annotations

import os
import pathlib
import signal
import tempfile
import time

import pytest

pytestmark = [pytest.mark.ray, pytest.mark.slow]
ray = pytest.importorskip("ray")

from ray_xlong import zygote


def test_the_hook_adds_the_client_and_keeps_the_users_runtime_env():
    env = zygote.hook({"env_vars": {"A": "1"}})
    assert env["env_vars"] == {"A": "1"}
    assert env["py_executable"].split()[-1] == zygote.__file__
    assert zygote.hook({"py_executable": "mine"})["py_executable"] == "mine"
    assert zygote.hook(None)["py_executable"] == env["py_executable"]


@ray.remote(num_cpus=0)
class Probe:
    def socket_path(self):
        return zygote.socket_path()

    def info(self):
        import numpy as np
        import torch

        return {"pid": os.getpid(), "ppid": os.getppid(), "threads": torch.get_num_threads(),
                "raylet": os.environ["RAY_RAYLET_PID"], "rand": float(np.random.rand()),
                "mine": os.environ.get("RX_ZYGOTE_TEST")}


def _cmdline(pid: int) -> str:
    return pathlib.Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()


def _wait(cond, timeout=180.0):
    end = time.time() + timeout
    while not cond():
        assert time.time() < end, "timed out"
        time.sleep(0.5)


def test_workers_fork_from_the_zygote_across_ray_sessions(monkeypatch, tmp_path):
    if ray.is_initialized():
        ray.shutdown()
    # a zygote of its own for this test (the key holds the preload list and the environment)
    monkeypatch.setenv("RX_ZYGOTE_PRELOAD", "numpy,torch")
    monkeypatch.setenv("RX_ZYGOTE_TEST", str(tmp_path))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("RAY_RUNTIME_ENV_HOOK", "ray_xlong.zygote.hook")
    path, zygote_pid = None, None
    try:
        for _ in range(2):
            monkeypatch.setenv("RAY_TMPDIR", tempfile.mkdtemp(prefix="rx", dir="/tmp"))
            ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
            try:
                if zygote_pid is None:    # the first worker starts it and starts plainly
                    first = Probe.remote()
                    assert "--serve" not in _cmdline(ray.get(first.info.remote())["ppid"])
                    path = ray.get(first.socket_path.remote())
                    _wait(lambda: os.path.exists(path))
                probes = [Probe.remote() for _ in range(2)]
                infos = ray.get([p.info.remote() for p in probes])
                ppids = {i["ppid"] for i in infos}
                assert len(ppids) == 1, infos
                (ppid,) = ppids
                assert f"--serve {path}" in _cmdline(ppid)
                zygote_pid = zygote_pid or ppid
                assert ppid == zygote_pid                  # one zygote for both sessions
                for i in infos:
                    assert i["raylet"] != str(ppid) and i["mine"] == str(tmp_path)
                    assert i["threads"] == 1               # OMP_NUM_THREADS, not the CPUs
                assert infos[0]["rand"] != infos[1]["rand"]     # NumPy re-seeded per child
                os.kill(infos[0]["pid"], signal.SIGKILL)
                with pytest.raises(ray.exceptions.RayActorError):
                    ray.get(probes[0].info.remote())
                ray.kill(probes[1])
                _wait(lambda gone=f"/proc/{infos[1]['pid']}": not os.path.exists(gone),
                      timeout=60)
            finally:
                ray.shutdown()
    finally:
        if zygote_pid:
            os.kill(zygote_pid, signal.SIGTERM)
