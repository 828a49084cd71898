"""Hosting an endpoint: uvicorn on the event loop that owns the engine.

The engine's batching loop and the HTTP server share one asyncio loop (the engine's futures
belong to it), so the server is started *on that loop*::

    server = await start_server(endpoint, host="127.0.0.1", port=0)   # in the loop; binds,
    endpoint.url == "http://127.0.0.1:<port>"                         # serves in a task
    await server.stop()

:class:`ThreadedEndpoint` builds the engine and the endpoint on a fresh loop in a daemon
thread (tests, benchmarks, a cell runner that already has its own loop uses ``start_server``).
:func:`build_endpoint` makes an endpoint for a model directory (HF or vLLM engine, the
directory's chat template). The socket has Nagle off, and a response's status line, headers and
body leave in one write (:class:`_Coalescing`; uvicorn writes the head apart).
"""

from __future__ import annotations

import asyncio
import pathlib
import socket
import threading
from typing import Any, Callable

import uvicorn

from ray_xlong.serving.app import Endpoint, EndpointConfig


class Server:
    """A running uvicorn server of one endpoint."""

    def __init__(self, server: uvicorn.Server, task: asyncio.Task, url: str) -> None:
        self.server, self.task, self.url = server, task, url

    async def stop(self) -> None:
        """Stop accepting, finish open responses, return once stopped."""
        self.server.should_exit = True
        await asyncio.wait({self.task}, timeout=10)


async def start_server(endpoint: Endpoint, *, host: str = "127.0.0.1", port: int = 0) -> Server:
    """Bind ``host:port`` (0: a free port) and serve ``endpoint`` on the running loop."""
    # IPPROTO_TCP spelled out: asyncio disables Nagle only on sockets whose proto says TCP, and
    # with Nagle a keep-alive response's second write waits out the client's delayed ACK
    # (~40 ms a call, measured); accepted sockets inherit TCP_NODELAY on Linux as well.
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.bind((host, port))
    sock.listen(1024)
    sock.setblocking(False)
    bound = sock.getsockname()[1]
    config = uvicorn.Config(endpoint.app, log_level="warning", lifespan="off",
                            timeout_graceful_shutdown=5, access_log=False,
                            http=_one_write_protocol() if _has("httptools") else "h11")
    server = uvicorn.Server(config)
    server.install_signal_handlers = lambda: None    # type: ignore[method-assign]
    task = asyncio.get_running_loop().create_task(server.serve(sockets=[sock]))
    while not server.started:
        if task.done():
            task.result()
        await asyncio.sleep(0.01)
    endpoint.url = f"http://{host}:{bound}"
    return Server(server, task, endpoint.url)


class _Coalescing:
    """A transport that holds a response's status line and headers until the next write (its
    body) or the loop's next turn, whichever comes first: uvicorn writes them apart, i.e. two
    ``send`` syscalls and two segments the client wakes up for (Nagle is off), ~0.4 ms each on
    this machine (profiled). Order is kept; nothing is held past one loop turn or a close."""

    def __init__(self, transport: asyncio.Transport) -> None:
        self._transport, self._held = transport, b""
        self._loop = asyncio.get_running_loop()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)

    def write(self, data: bytes) -> None:
        if self._held:
            data, self._held = self._held + data, b""
            self._transport.write(data)
        elif data.startswith(b"HTTP/"):
            self._held = bytes(data)
            self._loop.call_soon(self.flush)
        else:
            self._transport.write(data)

    def writelines(self, lines) -> None:
        self.flush()
        self._transport.writelines(lines)

    def flush(self) -> None:
        if self._held:
            data, self._held = self._held, b""
            self._transport.write(data)

    def close(self) -> None:
        self.flush()
        self._transport.close()


def _one_write_protocol() -> type:
    """uvicorn's httptools protocol on a :class:`_Coalescing` transport."""
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class OneWrite(HttpToolsProtocol):
        def connection_made(self, transport) -> None:         # type: ignore[override]
            super().connection_made(_Coalescing(transport))    # type: ignore[arg-type]
    return OneWrite


def _has(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def build_endpoint(model_dir: str | pathlib.Path, *, engine: str = "hf", seed: int = 0,
                   max_batch_size: int = 16, config: EndpointConfig | None = None) -> Endpoint:
    """An endpoint on a new engine for ``model_dir`` (call on the loop that will serve it)."""
    from ray_xlong.models.build import load_tokenizer
    from ray_xlong.rollout.chat import ChatFormatError
    from ray_xlong.rollout.formats import load_chat_format
    from ray_xlong.rollout.template_format import TemplateFormat

    path = pathlib.Path(model_dir)
    tokenizer = load_tokenizer(path)
    try:
        fmt, chat_error = load_chat_format(path), None
    except ChatFormatError as exc:                   # completions only; chat says why
        fmt, chat_error = None, str(exc)
    if engine == "vllm":
        from ray_xlong.rollout.vllm_engine import VLLMEngine

        eng: Any = VLLMEngine(path, max_batch_size=max_batch_size, seed=seed)
    elif engine == "hf":
        from ray_xlong.rollout.hf_engine import HFEngine

        eng = HFEngine(path, max_batch_size=max_batch_size, seed=seed)
    else:
        raise ValueError(f"engine must be 'hf' or 'vllm', got {engine!r}")
    if config is None:
        config = EndpointConfig(model_name=path.name,
                                max_model_len=endpoint_max_len(path, eng))
    return Endpoint(eng, tokenizer=tokenizer,
                    fmt=fmt if isinstance(fmt, TemplateFormat) else None, config=config,
                    chat_error=chat_error)


def endpoint_max_len(model_dir: pathlib.Path, engine: Any) -> int:
    """The endpoint's longest context: the engine's (a vLLM engine resolved it against the
    model), else the model's (``config.json``); a model that states none is an error naming
    ``EndpointConfig.max_model_len`` (never a silent default)."""
    from ray_xlong.rollout.engine_settings import resolve_max_model_len

    known = getattr(engine, "max_model_len", None)
    if isinstance(known, int):
        return known
    return resolve_max_model_len(model_dir, None, field="EndpointConfig.max_model_len")


class ThreadedEndpoint:
    """An endpoint (and its engine) on its own loop in a daemon thread."""

    def __init__(self, make: Callable[[], Endpoint], *, host: str = "127.0.0.1",
                 port: int = 0) -> None:
        """Args:
            make: builds the endpoint (called on the new loop).
            host, port: where to listen (port 0: any free port).
        """
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True,
                                       name="xlong-endpoint")
        self.thread.start()

        async def start() -> tuple[Endpoint, Server]:
            endpoint = make()
            return endpoint, await start_server(endpoint, host=host, port=port)

        self.endpoint, self.server = self.call(start())
        self.url = self.server.url

    def call(self, coro, timeout: float | None = 120.0):
        """Run a coroutine on the endpoint's loop and return its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        """Stop the server and the engine, then the loop."""
        async def stop() -> None:
            await self.server.stop()
            await self.endpoint.engine.close()

        try:
            self.call(stop(), timeout=30)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout=10)

    def __enter__(self) -> "ThreadedEndpoint":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
