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

The client imports nothing beyond the standard library.
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
import time

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
    h.update(str(os.stat(__file__).st_mtime_ns).encode())     # this file: the children's code
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
            os.execv(sys.executable, [sys.executable, os.path.abspath(__file__), "--serve",
                                      path, ",".join(preload)])
    finally:
        os._exit(0)


_LOCK_FD = 3


# -- the zygote -----------------------------------------------------------------------------------
class _Zygote:
    """The server: a listening socket, and per live child its client connection and the read end
    of the client's liveness pipe."""

    def __init__(self, path: str, set_by_imports: dict) -> None:
        import selectors

        try:                                 # the lock a client handed over (_start_zygote)
            held = os.readlink(f"/proc/self/fd/{_LOCK_FD}") == path + ".lock"
        except OSError:
            held = False
        self.lock_fd = _LOCK_FD if held else -1
        self.path = path
        self.set_by_imports = set_by_imports
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        tmp = f"{path}.{os.getpid()}"
        self.listener.bind(tmp)
        self.listener.listen(64)
        os.replace(tmp, path)                         # clients find it only once it is ready
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_w, False)
        signal.set_wakeup_fd(self.wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))     # leave no socket behind
        self.sel = selectors.DefaultSelector()
        self.sel.register(self.listener, selectors.EVENT_READ, "accept")
        self.sel.register(self.wake_r, selectors.EVENT_READ, "wake")
        self.children: dict[int, tuple[socket.socket, int]] = {}

    def run(self) -> None:
        last = time.monotonic()
        try:
            while self.children or time.monotonic() - last < IDLE_S:
                for key, _ in self.sel.select(timeout=5.0):
                    if key.data == "accept":
                        self._accept()
                        last = time.monotonic()
                    elif key.data == "wake":
                        os.read(self.wake_r, 512)
                    elif not os.read(key.fd, 64):  # a client is gone: so is its worker
                        try:
                            os.kill(key.data, signal.SIGKILL)
                        except OSError:
                            pass
                        self._forget_alive(key.data)
                if self._reap():
                    last = time.monotonic()
        finally:
            try:
                os.unlink(self.path)
            except OSError:
                pass

    def _accept(self) -> None:
        import selectors

        try:
            conn, _ = self.listener.accept()
        except OSError:
            return
        try:
            conn.settimeout(30)
            head, fds, _, _ = socket.recv_fds(conn, _HDR.size, 8)
            (n,) = _HDR.unpack(head)
            req = json.loads(_recv_exact(conn, n))
            conn.settimeout(None)
            if len(fds) != 4:
                raise ValueError(fds)
        except (OSError, EOFError, ValueError, struct.error):
            conn.close()
            return
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            self._child(conn, fds, req)                # never returns
        for fd in fds[:3]:
            os.close(fd)
        self.children[pid] = (conn, fds[3])
        self.sel.register(fds[3], selectors.EVENT_READ, pid)
        try:
            conn.sendall(_HDR.pack(pid))
        except OSError:                               # the client died meanwhile
            os.kill(pid, signal.SIGKILL)

    def _forget_alive(self, pid: int) -> None:
        conn, alive = self.children.get(pid, (None, -1))
        if alive >= 0:
            self.sel.unregister(alive)
            os.close(alive)
            self.children[pid] = (conn, -1)

    def _reap(self) -> bool:
        reaped = False
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return reaped
            if not pid:
                return reaped
            reaped = True
            self._forget_alive(pid)
            conn, _ = self.children.pop(pid, (None, -1))
            if conn is not None:
                try:
                    conn.sendall(_HDR.pack(status))
                except OSError:
                    pass
                conn.close()

    def _child(self, conn: socket.socket, fds: list[int], req: dict) -> None:
        code = 1
        try:
            signal.set_wakeup_fd(-1)
            os.setpgid(0, 0)                # a kill of the worker's group spares the zygote
            for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGHUP):
                signal.signal(sig, signal.SIG_DFL)
            signal.signal(signal.SIGINT, signal.default_int_handler)   # ray.cancel needs it
            self.sel.close()
            self.listener.close()
            conn.close()
            for other, alive in self.children.values():
                other.close()
                if alive >= 0:
                    os.close(alive)
            for fd in (self.wake_r, self.wake_w, self.lock_fd, fds[3]):
                if fd >= 0:
                    os.close(fd)
            for i in range(3):
                os.dup2(fds[i], i)
            for fd in fds[:3]:
                if fd > 2:
                    os.close(fd)
            _become(req, self.set_by_imports)
            import runpy

            try:
                runpy.run_path(req["argv"][0], run_name="__main__")
                code = 0
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        except BaseException:  # noqa: BLE001 - reported on the worker's stderr
            import traceback

            traceback.print_exc()
        finally:
            try:
                import atexit

                atexit._run_exitfuncs()
                sys.stdout.flush()
                sys.stderr.flush()
            finally:
                os._exit(code)


def serve(path: str, preload: tuple[str, ...]) -> None:
    """Import ``preload``, then fork a worker per request until idle for ``IDLE_S``."""
    import gc
    import importlib

    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
    # BLAS / OpenMP pools sized at import: one thread (a child's torch follows its own
    # OMP_NUM_THREADS below); not passed on to the children
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    before = dict(os.environ)
    for name in preload:
        try:
            importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001 - a module that fails is imported by the child
            print(f"zygote: {name}: {exc!r}", file=sys.stderr, flush=True)
    if "ray" in sys.modules:            # Ray's core state is per process: never fork it
        print("zygote: ray was imported; workers start the ordinary way", file=sys.stderr,
              flush=True)
        open(path + ".refused", "w").close()
        return
    threads = [t for t in os.listdir("/proc/self/task") if int(t) != os.getpid()]
    if threads:                          # e.g. an allocator's background thread: fork-safe
        print(f"zygote: {len(threads)} native thread(s) beside the main one", file=sys.stderr,
              flush=True)
    # what the imports set (vLLM's env overrides, ...): a child's own import would have too
    set_by_imports = {k: (before.get(k), v) for k, v in os.environ.items() if before.get(k) != v}
    gc.collect()
    gc.freeze()                                       # fewer copied pages in the children
    zygote = _Zygote(path, set_by_imports)
    print(f"zygote {os.getpid()}: serving {path}", file=sys.stderr, flush=True)
    zygote.run()


def _become(req: dict, set_by_imports: dict) -> None:
    """Take on the worker's own arguments, environment, directory and random state."""
    import tempfile

    env = dict(req["env"])
    for k, (old, new) in set_by_imports.items():     # as if it had imported them itself
        if env.get(k) == old:
            env[k] = new
    os.environ.clear()
    os.environ.update({k: v for k, v in env.items() if v is not None})
    tempfile.tempdir = None                          # its own TMPDIR
    os.chdir(req["cwd"])
    sys.argv = list(req["argv"])
    sys.path.insert(0, os.path.dirname(os.path.abspath(sys.argv[0])))
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    _torch_threads_from_env()
    if "torch" not in sys.modules:
        return
    from ray._private import utils  # the worker's own import, a bit early

    if hasattr(utils, "set_omp_num_threads_if_unset"):
        # Ray sets OMP_NUM_THREADS from the task's CPUs when it starts one: torch, imported
        # before that here, must hear of it (a fresh worker imports torch after)
        ray_set = utils.set_omp_num_threads_if_unset

        def set_omp_num_threads_if_unset() -> bool:
            done = ray_set()
            _torch_threads_from_env()
            return done

        utils.set_omp_num_threads_if_unset = set_omp_num_threads_if_unset


def _torch_threads_from_env() -> None:
    torch = sys.modules.get("torch")
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if torch is not None and threads.isdigit() and int(threads) > 0:
        torch.set_num_threads(int(threads))


if __name__ == "__main__":
    if len(sys.argv) >= 2 and sys.argv[1] == "--serve":
        serve(sys.argv[2], tuple(n for n in sys.argv[3].split(",") if n))
    else:
        client(sys.argv[1:])
