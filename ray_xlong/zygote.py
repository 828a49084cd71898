"""Ray workers forked from an interpreter that has already imported torch, transformers, vLLM's
tool parsers and the data libraries (a *zygote*), instead of each importing them again.

A cell's Learner or runner spends 10-30 s of CPU importing its libraries before it does any work;
a cell rebuilt after a fault pays it again, and a test suite that starts hundreds of actors pays
it hundreds of times. With the hook on, a worker process forks from the zygote in ~0.1 s::

    RAY_RUNTIME_ENV_HOOK=ray_xlong.zygote.hook python my_job.py     # before ray.init

How: the hook sets the job's ``runtime_env["py_executable"]`` to this file. Ray then starts each
worker as ``python zygote.py default_worker.py --args...``; that client asks the zygote for the
environment's fork over a Unix socket, hands it its stdin/stdout/stderr and environment, and
lives as long as the forked worker (its exit status, signals forwarded; the worker dies with the
client, so Ray's kill of the process it started still kills the worker). The worker registers
with the raylet under its own pid, as in a container.

* One zygote per environment: a hash of the interpreter, the preload list, the environment
  (``NOT_KEYED``: per-worker variables and those its imports set left out) and this file's
  mtime. It starts with the first worker that finds none, holds ``<socket>.lock`` (``flock``)
  for its life, and leaves after ``IDLE_S`` with nothing to serve.
* Until it has imported everything (tens of seconds), workers start the ordinary way; a worker
  never waits for it. ``RX_ZYGOTE=0`` turns the client into the ordinary start.
* It watches each client's liveness pipe and kills the worker of a client that is gone; a
  client outlives a zygote that died, with its worker (a pidfd).
* A fork is fork-safe here: the zygote only imports (never Ray, no CUDA; BLAS pools of one
  thread), and the child takes on its own environment, re-seeds NumPy and sets torch's threads
  from the ``OMP_NUM_THREADS`` Ray gives the task.

The client imports nothing beyond the standard library; the zygote is ``zygote_server.py``.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import select
import signal
import socket
import struct
import sys

PRELOAD = ("torch", "transformers", "transformers.modeling_utils", "vllm.tool_parsers", "pandas",
           "pyarrow", "gymnasium", "scipy")
"""What the zygote imports before it forks (``RX_ZYGOTE_PRELOAD``: a comma-separated list):
~22 s of CPU once, leaving a cell actor ~3 s (Ray, RLlib and this package). Never Ray itself:
its core reads the raylet's pid and the job id once per process, so a zygote that imported it
could serve one Ray session only (the zygote refuses to serve if a module imported it)."""
IDLE_S = 120.0
"""A zygote with no live child and no request for this long exits."""
NOT_KEYED = ("RAY_RAYLET_PID", "RAY_JOB_ID", "RAY_LD_PRELOAD_ON_WORKERS", "SPT_NOENV",
             "PYTHONBREAKPOINT", "OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES", "RAY_TMPDIR",
             "TMPDIR", "PWD", "OLDPWD", "_", "SHLVL", "LD_LIBRARY_PATH",
             # set by the preloaded libraries' own imports (a driver that imported them first
             # passes them on to its workers)
             "TORCHINDUCTOR_CACHE_DIR", "TORCHINDUCTOR_COMPILE_THREADS",
             "PYTORCH_NVML_BASED_CUDA_CHECK", "TRITON_CACHE_AUTOTUNING",
             "TILELANG_CLEANUP_TEMP_FILES", "RAY_CLIENT_MODE", "PYGAME_HIDE_SUPPORT_PROMPT",
             "TF_CPP_MIN_LOG_LEVEL")
"""Variables not part of the zygote's key: they differ between workers of one environment, are
read after the preloaded imports (the child gets its own), or are set by those imports. Any
other difference, e.g. a job's ``env_vars``, is another environment."""
NOT_KEYED_PREFIXES = ("PYTEST_", "VLLM_", "WANDB_", "MLFLOW_", "_MLFLOW_", "CRC32C_")
"""Left out too: vLLM's variables (read when used), and those of pytest and of the trackers'
clients (W&B, MLflow: a driver that imported MLflow passes on a random session id), which no
preloaded library reads."""
_HDR = struct.Struct("!I")
_SERVER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "zygote_server.py")
"""The zygote itself (the children's code)."""


def hook(runtime_env):
    """``RAY_RUNTIME_ENV_HOOK``: the job's workers start through this file (see the module)."""
    env = dict(runtime_env or {})
    env.setdefault("py_executable", f"{sys.executable} {os.path.abspath(__file__)}")
    return env


def _preload() -> tuple[str, ...]:
    names = os.environ.get("RX_ZYGOTE_PRELOAD")
    return tuple(n for n in names.split(",") if n) if names is not None else PRELOAD


def socket_path(preload: tuple[str, ...] | None = None) -> str:
    """Where this environment's zygote listens (the process's environment, as a worker's)."""
    return f"/tmp/rxz-{_key(_preload() if preload is None else preload)}.sock"


def _key(preload: tuple[str, ...]) -> str:
    h = hashlib.sha1()
    h.update(sys.executable.encode())
    h.update(",".join(preload).encode())
    for k in sorted(os.environ):
        if k not in NOT_KEYED and not k.startswith(NOT_KEYED_PREFIXES):
            h.update(f"{k}={os.environ[k]}\0".encode())
    for code in (__file__, _SERVER):                  # the client's and the children's code
        h.update(str(os.stat(code).st_mtime_ns).encode())
    return h.hexdigest()[:16]


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise EOFError
        buf += chunk
    return buf


# -- the client: what Ray starts as the worker ---------------------------------------------------
def client(argv: list[str]) -> None:
    """Run ``argv`` (``default_worker.py --args``) as a fork of the zygote, or exec it plainly."""
    plain = [sys.executable, *argv]
    if os.environ.get("RX_ZYGOTE", "1") == "0":
        os.execv(sys.executable, plain)
    preload = _preload()
    path = socket_path(preload)
    if os.path.exists(path + ".refused"):
        os.execv(sys.executable, plain)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(path)
    except OSError:
        sock.close()
        _start_zygote(path, preload)
        os.execv(sys.executable, plain)               # this one starts the ordinary way
    # The zygote watches the read end: when we exit (killed too), it kills the worker. Our
    # write end closes on exec, so a plain start below leaves no orphan fork behind.
    alive_r, _alive_w = os.pipe()
    body = json.dumps({"argv": argv, "env": dict(os.environ), "cwd": os.getcwd()}).encode()
    try:
        socket.send_fds(sock, [_HDR.pack(len(body))], [0, 1, 2, alive_r])
        sock.sendall(body)
        os.close(alive_r)
        (pid,) = _HDR.unpack(_recv_exact(sock, 4))
    except (OSError, EOFError):
        os.execv(sys.executable, plain)
    try:
        pidfd = os.pidfd_open(pid)                    # no pid reuse between here and a signal
    except OSError:
        pidfd = None

    def forward(sig, _frame):
        try:
            if pidfd is not None:
                signal.pidfd_send_signal(pidfd, sig)
        except OSError:
            pass

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1,
                signal.SIGUSR2):
        signal.signal(sig, forward)
    try:
        (status,) = _HDR.unpack(_recv_exact(sock, 4))
    except (OSError, EOFError):             # the zygote is gone; the worker lives on: wait
        if pidfd is not None:
            select.select([pidfd], [], [])
        os._exit(1)
    _exit_as(status)


def _exit_as(status: int) -> None:
    """End this process the way the worker ended (its exit code, or its signal)."""
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        if sig not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
        os._exit(128 + sig)
    os._exit(os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 1)


def _start_zygote(path: str, preload: tuple[str, ...]) -> None:
    """Start the zygote for ``path`` unless one is loading or serving: it holds ``.lock``
    (``flock``) for its whole life, and the kernel lets go of it however it ends."""
    lock = os.open(path + ".lock", os.O_CREAT | os.O_WRONLY | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(lock)
        return
    try:
        os.unlink(path)                              # a dead zygote's socket
    except OSError:
        pass
    # twice forked: an orphan of no worker (Ray kills a worker's children when it exits)
    pid = os.fork()
    if pid:
        os.close(lock)
        os.waitpid(pid, 0)
        return
    try:
        os.setsid()
        if os.fork() == 0:
            log = os.open(path + ".log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            null = os.open(os.devnull, os.O_RDONLY)
            os.dup2(null, 0)
            os.dup2(log, 1)
            os.dup2(log, 2)
            os.dup2(lock, _LOCK_FD)                  # inherited by the zygote, held for life
            os.set_inheritable(_LOCK_FD, True)       # (dup2 onto itself keeps close-on-exec)
            os.closerange(_LOCK_FD + 1, 1 << 16)
            os.execv(sys.executable, [sys.executable, _SERVER, path, ",".join(preload)])
    finally:
        os._exit(0)


_LOCK_FD = 3


if __name__ == "__main__":
    client(sys.argv[1:])
