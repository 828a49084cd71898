"""The endpoint on a rollout cell, and ``ray-xlong serve`` (embedded Ray, one cell).

A rollout cell's runner hosts the endpoint on its own event loop, on the same engine its
built-in runs use (``attach``): a run opened through the endpoint is a live run of the cell
(the cell may not sleep while it has one), a draining cell refuses new endpoint runs and keeps
serving live ones, and the driver hands each run the URL of the cell it was started on
(``AgentEnvRunner.endpoint_url``). External-agent tasks (``agents.AGENT_TASKS``; a job's
``XLongOptions.agent_task``, registered in every runner) start like built-in tasks: the runner
opens the run on its own endpoint and hands the agent that base URL; the run ends on the cell
and is processed there like any other.

``ray-xlong serve``::

    ray.init(embedded, small)  ─►  EndpointCell actor: engine (hf | vllm) + endpoint on its loop
    prints "serving http://H:P"    Ctrl-C: the server stops, the engine closes, Ray shuts down
"""

from __future__ import annotations

import signal
import sys
import threading
from typing import Any

from ray_xlong.serving.app import Endpoint, EndpointConfig
from ray_xlong.serving.server import (Server, ThreadedEndpoint, build_endpoint,
                                      endpoint_max_len, start_server)


async def attach(engine: Any, model_dir: str, *, host: str = "127.0.0.1", port: int = 0
                 ) -> tuple[Endpoint, Server]:
    """An endpoint on a cell's existing ``engine`` (call on the engine's loop)."""
    import pathlib

    from ray_xlong.models.build import load_tokenizer
    from ray_xlong.rollout.chat import ChatFormatError
    from ray_xlong.rollout.formats import load_chat_format
    from ray_xlong.rollout.template_format import TemplateFormat

    path = pathlib.Path(model_dir)
    try:
        fmt, chat_error = load_chat_format(path), None
    except ChatFormatError as exc:                   # completions only; chat says why
        fmt, chat_error = None, str(exc)
    config = EndpointConfig(model_name=path.name,
                            max_model_len=endpoint_max_len(path, engine))
    endpoint = Endpoint(engine, tokenizer=load_tokenizer(path),
                        fmt=fmt if isinstance(fmt, TemplateFormat) else None, config=config,
                    chat_error=chat_error)
    return endpoint, await start_server(endpoint, host=host, port=port)


class EndpointCell:
    """A one-cell rollout side for ``serve``: an engine and its endpoint (a Ray actor)."""

    def __init__(self, model_dir: str, engine: str, host: str, port: int) -> None:
        self.hosted = ThreadedEndpoint(lambda: build_endpoint(model_dir, engine=engine),
                                       host=host, port=port)

    def url(self) -> str:
        """The endpoint's URL."""
        return self.hosted.url

    def drain(self) -> int:
        """Refuse new runs; returns the live ones."""
        self.hosted.endpoint.runs.draining = True
        return len(self.hosted.endpoint.runs.live)

    def stop(self) -> None:
        """Stop the server and the engine."""
        self.hosted.close()


def serve_forever(model_dir: str, *, engine: str = "hf", host: str = "127.0.0.1",
                  port: int = 8000) -> int:
    """``ray-xlong serve``: returns 0 after Ctrl-C / SIGTERM."""
    import ray

    ray.init(num_cpus=1, include_dashboard=False, object_store_memory=80 * 1024 * 1024,
             log_to_driver=False, configure_logging=False)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        cell = ray.remote(num_cpus=0)(EndpointCell).remote(model_dir, engine, host, port)
        url = ray.get(cell.url.remote())
        print(f"serving {url}", flush=True)
        while not stop.wait(0.5):
            pass
        print("stopping", file=sys.stderr, flush=True)
        ray.get(cell.stop.remote(), timeout=30)
    finally:
        ray.shutdown()
    return 0


async def start_runs_on_endpoint(endpoint: Endpoint, make, *, seed: int, run_id: str,
                                 group_id: str):
    """The coroutine of one external-agent run on a cell's endpoint."""
    from ray_xlong.serving.agents import run_agent

    return await run_agent(endpoint, make(seed), run_id=run_id, group_id=group_id)

