"""Awaiting untrusted work under limits: tools, scores and agent loops that may never return.

``asyncio.wait_for`` is not enough for a harness serving many runs on one event loop:

* on timeout it *waits for the cancelled work to finish*, so a tool that swallows
  ``CancelledError`` hangs the caller anyway — :func:`bounded` cancels and walks away;
* blocking (sync) work cannot be cancelled at all; run in the loop's default executor, work that
  never returns eventually holds every worker the engine also needs (and blocks interpreter
  exit) — :func:`in_thread` gives each call its own daemon thread instead::

      await bounded(call_tool(env, name, args), timeout_s)     async tool: awaited in the loop
                                                               sync tool: its own daemon thread
      ─► result | asyncio.TimeoutError (the work is cancelled / abandoned, never awaited)

Invariant: ``bounded`` returns or raises within ``timeout_s`` (plus one loop turn), whatever the
work does, as long as the work does not block the event loop itself (an ``async`` tool must not
call blocking code: make ``call_tool`` sync instead and it runs in a thread).
"""

from __future__ import annotations

import asyncio
import inspect
import threading
from typing import Any, Awaitable, Callable

from ray_xlong.rollout.tasks.base import TaskEnv


def call_tool(env: TaskEnv, name: str, args: str) -> Awaitable[Any]:
    """``env.call_tool(name, args)``: awaited if async, in its own thread if sync."""
    if inspect.iscoroutinefunction(env.call_tool):
        return env.call_tool(name, args)

    async def sync_tool() -> Any:
        out = await in_thread(env.call_tool, name, args)
        return await out if inspect.isawaitable(out) else out
    return sync_tool()


def in_thread(fn: Callable[..., Any], *args: Any) -> asyncio.Future:
    """Run blocking ``fn(*args)`` in a new daemon thread; its result as a future of this loop.

    Not the loop's default executor: a call that never returns holds its own thread only (the
    engine's batches and other runs' calls keep theirs), and does not block interpreter exit."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def settle(value: Any, exc: BaseException | None) -> None:
        if future.done():                    # timed out and abandoned
            return
        if exc is not None:
            future.set_exception(exc)
        else:
            future.set_result(value)

    def work() -> None:
        try:
            value, exc = fn(*args), None
        except BaseException as e:  # noqa: BLE001 - handed to the awaiting coroutine
            value, exc = None, e
        try:
            loop.call_soon_threadsafe(settle, value, exc)
        except RuntimeError:                 # the loop is closed: nobody waits any more
            pass

    threading.Thread(target=work, name=f"xlong-{getattr(fn, '__name__', 'call')}",
                     daemon=True).start()
    return future


async def bounded(awaitable: Awaitable[Any], timeout_s: float) -> Any:
    """Await ``awaitable`` for at most ``timeout_s`` seconds (``asyncio.TimeoutError`` after).

    Unlike ``asyncio.wait_for`` it does not wait for the cancelled work to finish: a tool that
    swallows ``CancelledError`` is cancelled and left behind (its outcome discarded), so it
    cannot hang the run. Cancelling the caller cancels the work too."""
    task = asyncio.ensure_future(awaitable)
    try:
        done, _ = await asyncio.wait({task}, timeout=timeout_s)
    except BaseException:
        abandon(task)
        raise
    if not done:
        abandon(task)
        raise asyncio.TimeoutError
    return task.result()


def abandon(task: asyncio.Future) -> None:
    """Cancel ``task`` without waiting for it; its eventual outcome is retrieved and dropped."""
    task.cancel()
    task.add_done_callback(lambda t: t.cancelled() or t.exception())
