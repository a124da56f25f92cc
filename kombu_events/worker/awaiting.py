"""Awaiting ``async def`` handlers: one asyncio event loop per pool process or thread, many handlers in flight.

The pool runs a batch of messages at a time in each process (prefork) or thread
(threads, solo): the runner calls the sync handlers of a batch one by one and hands
the coroutines of its ``async def`` handlers to :func:`gather`, which awaits them
together, at most ``async_concurrency`` at once, on this thread's loop. The loop is
made on first use and kept (clients a handler keeps in module globals stay bound to
it); a forked child makes its own. Under gevent and eventlet nothing here runs: the
worker refuses ``async def`` handlers at start-up (:func:`refuse`).
"""
from __future__ import annotations

__all__ = ["run", "gather", "around", "refuse", "refused", "Cancelled"]

import asyncio
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Coroutine, Sequence, TypeVar

if TYPE_CHECKING:
    from ..core.event import Event
    from ..middleware.base import Hooks

logger = logging.getLogger(__name__)

T = TypeVar("T")

_local = threading.local()
#: Why coroutines cannot be awaited in this process (a green pool), or None.
_refused: str | None = None
#: Runs a coroutine asked for from a thread whose own asyncio loop is running (an async test calling the stub).
_aside: ThreadPoolExecutor | None = None
_aside_lock = threading.Lock()


class Cancelled(Exception):
    """The handler's coroutine was cancelled before it finished (a retryable failure, not a shutdown)."""


def refuse(why: str | None) -> None:
    """From now on (None: no longer) :func:`run` refuses coroutines in this process, saying ``why``."""
    global _refused
    _refused = why


def refused() -> str | None:
    """Why this process cannot await a handler's coroutine (a green pool), or None."""
    return _refused


def _loop() -> asyncio.AbstractEventLoop:
    """This thread's loop: made on first use, kept; a forked child or a closed loop gets a new one."""
    loop: asyncio.AbstractEventLoop | None = getattr(_local, "loop", None)
    if loop is None or loop.is_closed() or getattr(_local, "pid", None) != os.getpid():
        loop = asyncio.new_event_loop()
        _local.loop, _local.pid = loop, os.getpid()
    return loop


def run(coroutine: Coroutine[Any, Any, T]) -> T:
    """Run ``coroutine`` to its end on this thread's loop and return its result.

    RuntimeError if this process refuses coroutines (the coroutine is closed unrun). If an
    asyncio loop already runs in this thread (the test kit called from an async test), it
    runs on a loop of a helper thread instead.
    """
    if _refused is not None:
        coroutine.close()
        raise RuntimeError(_refused)
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return _complete(coroutine)
    return _helper().submit(_complete, coroutine).result()


def _complete(coroutine: Coroutine[Any, Any, T]) -> T:
    loop = _loop()
    task = loop.create_task(coroutine)
    try:
        return loop.run_until_complete(task)
    except BaseException:
        task.cancel()  # e.g. SystemExit from a handler: what is left is cancelled on the loop's next run
        raise


def _helper() -> ThreadPoolExecutor:
    global _aside
    with _aside_lock:
        if _aside is None:
            _aside = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kombu-events-asyncio")
        return _aside


def gather(calls: Sequence[Callable[[], Awaitable[T]]], *, limit: int) -> list[T]:
    """``[await call() for call in calls]``, awaited together, at most ``limit`` at once; results in order.

    Each call must return its own result rather than raise (the runner's do): one that
    raises ends the whole gather with that exception.
    """
    return run(_bounded(calls, limit))


async def _bounded(calls: Sequence[Callable[[], Awaitable[T]]], limit: int) -> list[T]:
    semaphore = asyncio.Semaphore(limit)  # made inside the loop (Python 3.9 binds it to the current loop)

    async def one(call: Callable[[], Awaitable[T]]) -> T:
        async with semaphore:
            return await call()

    return list(await asyncio.gather(*(one(call) for call in calls)))


async def around(hooks: Hooks, event: Event[Any], call: Callable[[], Awaitable[float]]) -> float:
    """``await call()`` inside every ``handling(event)`` context: :meth:`Hooks.around` for a coroutine.

    The contexts are entered and left in the handler's own task, so what they keep in
    context variables (a tracing span) is the handler's alone; other handlers run in the
    same thread meanwhile. The same rules as for a sync handler: a context that fails is
    logged and skipped, ``Handled`` on entering skips the handler, ``Retry``/``Archive``
    from a context end the attempt, the handler's exception always propagates.
    """
    entered = hooks.enter(event)
    if entered is None:
        return time.perf_counter()  # skipped: the handler "started" now and took no time
    try:
        started = await call()
    except BaseException as exc:
        hooks.leave(entered, exc)
        raise
    hooks.leave(entered, None)
    return started

