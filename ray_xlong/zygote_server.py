"""The zygote of :mod:`ray_xlong.zygote`: imports the preload list, then forks a Ray worker per
client request (run as ``python zygote_server.py <socket> <preload,...>`` by the first client).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import struct
import sys
import time

from ray_xlong.zygote import _HDR, _LOCK_FD, IDLE_S, _recv_exact


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
    serve(sys.argv[1], tuple(n for n in sys.argv[2].split(",") if n))
