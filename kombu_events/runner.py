"""What runs inside the worker's pool: decode, call the handler, report an Outcome.

The arguments cross the prefork pipe, so they are plain values and the handler is
found again by queue name in this process's registry (filled at import time, before
the pool forks). This function never raises: every ending becomes an Outcome.
"""
from __future__ import annotations

__all__ = ["run", "classify"]

import traceback as tb
from typing import Any

from . import decision
from .codec import decode
from .errors import DecodeError
from .event import Event
from .failures import Archive, Retry
from .handlers import Handler

_registry: dict[str, tuple[Handler, frozenset[str], int]] = {}

_OK = decision.Outcome(decision.OK)


def _lookup(queue: str) -> tuple[Handler, frozenset[str], int] | None:
    entry = _registry.get(queue)
    if entry is None:
        from .events import registered

        for events in registered:
            try:
                handler = events.handler_for(queue)
            except Exception:  # another service's bad configuration is not this message's problem
                continue
            if handler is not None:
                entry = _registry[queue] = (handler, events.accept, events.settings.traceback_limit)
                break
    return entry


def classify(exc: BaseException, handler: Handler, traceback_limit: int, final: bool = True) -> decision.Outcome:
    """Outcome for an exception raised by ``handler``.

    The traceback only goes into archive headers, and formatting one is costly
    (Python 3.11 parses source for its markers), so a failure that will be retried
    (not ``final``) carries none.
    """
    name = f"{type(exc).__module__}.{type(exc).__qualname__}"
    exception = f"{name}: {exc}"

    def trace() -> str:
        if not traceback_limit:
            return ""
        return "".join(tb.format_exception(type(exc), exc, exc.__traceback__))[-traceback_limit:]

    if isinstance(exc, Retry):
        delay = None if exc.delay is None else exc.delay * 1000
        return decision.Outcome(decision.RETRY, str(exc), exception, trace() if final else "", delay)
    if isinstance(exc, Archive):
        return decision.Outcome(decision.ARCHIVE, exc.reason, exception, trace())
    if handler.dont_retry and isinstance(exc, handler.dont_retry):
        return decision.Outcome(decision.ARCHIVE, f"dont_retry: {exception}", exception, trace())
    if not isinstance(exc, handler.retry_for):
        return decision.Outcome(decision.ARCHIVE, f"not in retry_for: {exception}", exception, trace())
    return decision.Outcome(decision.FAILED, exception, exception, trace() if final else "")


def run(queue: str, body: bytes, content_type: str | None, content_encoding: str | None,
        meta: tuple[Any, ...] | None = None, final: bool = True) -> decision.Outcome:
    """Decode and handle one message.

    ``meta`` = (routing_key, attempt, headers, properties) for ``bind=True`` handlers;
    ``final``: no retry is left, so a failure needs its traceback for the archive.
    """
    entry = _registry.get(queue) or _lookup(queue)
    if entry is None:
        return decision.Outcome(decision.LOST, f"no handler for queue {queue!r} in this process")
    handler, accept, traceback_limit = entry
    try:
        payload = body if handler.raw else decode(body, content_type, content_encoding, accept)
    except DecodeError as exc:
        return decision.Outcome(decision.UNDECODABLE, str(exc), f"{type(exc).__name__}: {exc}")
    try:
        if handler.bind:
            routing_key, attempt, headers, properties = meta
            handler.fn(Event(payload, routing_key, queue, attempt, headers, properties, body))
        else:
            handler.fn(payload)
    except Exception as exc:
        return classify(exc, handler, traceback_limit, final)
    return _OK
