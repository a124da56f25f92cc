"""What runs inside the worker's pool: decode, call the handler, report an Outcome.

The arguments cross the prefork pipe, so they are plain values, and the handler's
route is found by queue name in this process's registry (resolved before the pool
forked). :func:`run` raises no ``Exception``: every ending becomes an Outcome (a handler
that raises ``SystemExit`` or ``KeyboardInterrupt`` ends its process, as in a Celery task).
"""
from __future__ import annotations

__all__ = ["run"]

import logging
import time
import types
from functools import partial
from typing import Any, Callable

from .. import registry, signals
from ..core import decision
from ..core.codec import decompress
from ..core.envelopes import Envelope, unwrap
from ..core.event import Event
from ..errors import Archive, DecodeError, InvalidPayload
from ..registry import Route

logger = logging.getLogger(__name__)

Meta = tuple[str, int, dict[str, Any], dict[str, Any]]


def run(queue: str, body: bytes, content_type: str | None, content_encoding: str | None,
        meta: Meta | None = None, final: bool = True) -> decision.Outcome:
    """Decode and handle one message; raises no ``Exception``.

    ``meta`` = (routing_key, attempt, headers, properties) of the delivery; ``final``:
    no retry is left, so a failure needs its traceback for the archive.
    """
    try:
        route = registry.route(queue)
        if route is None:
            return decision.Outcome(decision.LOST, f"no handler for queue {queue!r} in this process")
        return _run(route, queue, body, content_type, content_encoding, meta, final)
    except Exception as exc:  # a bug of ours must not end the pool process or the worker
        logger.exception("kombu-events: running the handler of %s failed", queue)
        what = decision.describe(exc)
        return decision.Outcome(decision.FAILED, f"kombu-events error: {what}", what)


def _run(route: Route, queue: str, body: bytes, content_type: str | None, content_encoding: str | None,
         meta: Meta | None, final: bool) -> decision.Outcome:
    handler = route.handler
    if route.hooks.on_admit:
        refused = route.hooks.admit(queue)
        if refused is not None:
            return refused
    headers, properties = (meta[2], meta[3]) if meta else ({}, {})
    envelope = None
    try:
        compression = headers.get("compression")
        if compression is not None:
            body = decompress(body, compression, max_bytes=route.max_body_bytes)
        if handler.raw:
            payload = body
        else:
            payload, envelope = unwrap(body, content_type, content_encoding, headers, properties,
                                       route.decode)
    except DecodeError as exc:
        return decision.Outcome(decision.UNDECODABLE, str(exc), f"{type(exc).__name__}: {exc}")
    if handler.message_type is not None and not _of_type(handler.message_type, envelope, properties):
        return decision.Outcome(decision.SKIPPED, f"not of type {handler.message_type!r}")
    if handler.contract is not None:
        try:
            payload = handler.contract.validate(payload)
        except InvalidPayload as exc:
            return _invalid(exc, payload, route, queue, meta, body, envelope, final)
    hooks = route.hooks
    event = None
    # Only a failure needs an Event for handler_failed (e.g. Sentry's receiver): built then, not per message.
    if handler.bind or hooks.on_handling or signals.handler_started.receivers or signals.handler_succeeded.receivers:
        event = _event(payload, queue, meta, body, envelope)
        if signals.handler_started.receivers:
            signals.handler_started.send(sender=handler.fn, event=event)
    argument = event if handler.bind else payload
    started = time.perf_counter()
    try:
        if event is not None and hooks.on_handling:  # time the handler, not the middleware around it
            started = hooks.around(event, partial(_timed, handler.fn, argument))
        else:
            _ran(handler.fn(argument))
    except Exception as exc:
        duration_ms = (time.perf_counter() - started) * 1000
        outcome = decision.classify(exc, retry_for=handler.retry_for, dont_retry=handler.dont_retry,
                                    traceback_limit=route.traceback_limit, final=final, duration_ms=duration_ms)
        if signals.handler_failed.receivers:
            if event is None:
                event = _event(payload, queue, meta, body, envelope)
            signals.handler_failed.send(sender=handler.fn, event=event, exception=exc, traceback=exc.__traceback__,
                                        duration_ms=duration_ms, outcome=outcome,
                                        action=decision.likely_action(outcome, final=final))
        return outcome
    duration_ms = (time.perf_counter() - started) * 1000
    if signals.handler_succeeded.receivers:
        signals.handler_succeeded.send(sender=handler.fn, event=event, duration_ms=duration_ms)
    return decision.Outcome(decision.OK, duration_ms=duration_ms)


def _of_type(wanted: str, envelope: Envelope | None, properties: dict[str, Any]) -> bool:
    """Whether the message is of type ``wanted``: its envelope's type, else its AMQP ``type`` property."""
    if envelope is not None:
        return envelope.matches(wanted)
    return properties.get("type") == wanted


def _invalid(exc: InvalidPayload, payload: Any, route: Route, queue: str, meta: Meta | None, body: bytes,
             envelope: Envelope | None, final: bool) -> decision.Outcome:
    """The payload does not fit the handler's contract: archived at once; ``handler_failed`` tells why."""
    what = decision.describe(exc)
    outcome = decision.Outcome(decision.INVALID, str(exc), what)
    if signals.handler_failed.receivers:
        signals.handler_failed.send(sender=route.handler.fn, event=_event(payload, queue, meta, body, envelope),
                                    exception=exc, traceback=None, duration_ms=0.0, outcome=outcome,
                                    action=decision.likely_action(outcome, final=final))
    return outcome


def _timed(fn: Callable[[Any], Any], argument: Any) -> float:
    """Call ``fn(argument)``; return when it started."""
    started = time.perf_counter()
    _ran(fn(argument))
    return started


#: What a call returns when it did not run the body it was asked to (registration refuses most such handlers;
#: a sync decorator around an async function gets through).
_NOT_RUN = (types.CoroutineType, types.GeneratorType, types.AsyncGeneratorType)


def _ran(result: Any) -> None:
    """Raise Archive if ``result`` shows the handler's body did not run: never ack what did not run."""
    if result is not None and isinstance(result, _NOT_RUN):
        if not isinstance(result, types.AsyncGeneratorType):
            result.close()  # no "never awaited" warning: the archive reason says it
        raise Archive(f"the handler returned a {type(result).__name__} instead of running: kombu-events "
                      f"cannot await or iterate it; make the handler a plain function")


def _event(payload: Any, queue: str, meta: Meta | None, body: bytes, envelope: Envelope | None = None) -> Event[Any]:
    """The Event a bound handler, a ``handling`` middleware or a pool signal gets."""
    routing_key, attempt, headers, properties = meta or ("", 0, {}, {})
    # Copies: under the solo and threads pools these are the delivery's own, which a retry or
    # archive copy is built from; what a handler changes must not leak into it.
    return Event(payload, routing_key, queue, attempt, dict(headers), dict(properties), body, envelope)
