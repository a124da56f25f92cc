"""What runs inside the worker's pool: decode, call the handler, report an Outcome.

The arguments cross the prefork pipe, so they are plain values, and the handler's
route is found by queue name in this process's registry (resolved before the pool
forked). :func:`run` raises no ``Exception``: every ending becomes an Outcome (a handler
that raises ``SystemExit`` or ``KeyboardInterrupt`` ends its process, as in a Celery task).
"""
from __future__ import annotations

__all__ = ["run", "run_batch", "Item", "Outcomes"]

import asyncio
import inspect
import logging
import time
import types
from functools import partial
from typing import Any, Callable, Sequence

from .. import registry, signals
from ..core import decision
from ..core.codec import decompress
from ..core.envelopes import Envelope, unwrap
from ..core.event import Event
from ..errors import Archive, DecodeError, InvalidPayload
from ..registry import Route
from . import awaiting

logger = logging.getLogger(__name__)

Meta = tuple[str, int, dict[str, Any], dict[str, Any]]
#: The arguments of :func:`run` for one message: (queue, body, content_type, content_encoding, meta, final).
Item = tuple[str, bytes, "str | None", "str | None", Any, bool]


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


class Outcomes(list[decision.Outcome]):
    """The Outcomes of a batch, in order, and how long the batch ran before awaiting (``elapsed_ms``)."""

    elapsed_ms: float = 0.0


def run_batch(items: Sequence[Item], async_limit: int = 100) -> Outcomes:
    """Decode and handle each of ``items`` (the arguments of :func:`run`); their Outcomes, in order.

    Sync handlers run one after another, in order; the coroutines of ``async def``
    handlers are then awaited together, at most ``async_limit`` at once (the service's
    ``async_concurrency``). Raises no ``Exception``: each message ends in its own Outcome.
    """
    started = time.perf_counter()
    outcomes = Outcomes()
    waiting: list[tuple[int, _Call]] = []
    for queue, body, content_type, content_encoding, meta, final in items:
        try:
            route = registry.route(queue)
            if route is None:
                outcomes.append(decision.Outcome(decision.LOST, f"no handler for queue {queue!r} in this process"))
                continue
            ready = _prepare(route, queue, body, content_type, content_encoding, meta, final)
            if isinstance(ready, decision.Outcome):
                outcomes.append(ready)
            elif ready.awaits:
                waiting.append((len(outcomes), ready))
                outcomes.append(_NOT_AWAITED)
            else:
                outcomes.append(_call(ready))
        except Exception as exc:
            outcomes.append(_bug(queue, exc))
    outcomes.elapsed_ms = (time.perf_counter() - started) * 1000
    if waiting:
        try:
            awaited = awaiting.gather([partial(_call_async, ready) for _, ready in waiting], limit=async_limit)
        except Exception as exc:  # e.g. this process refuses coroutines: a green pool
            awaited = [_bug(ready.queue, exc) for _, ready in waiting]
        for (index, _), outcome in zip(waiting, awaited):
            outcomes[index] = outcome
    return outcomes


def _bug(queue: str, exc: Exception) -> decision.Outcome:
    """The Outcome of a bug of ours (logged): the message is retried, the pool process lives on."""
    logger.error("kombu-events: running the handler of %s failed", queue, exc_info=exc)
    what = decision.describe(exc)
    return decision.Outcome(decision.FAILED, f"kombu-events error: {what}", what)


def _run(route: Route, queue: str, body: bytes, content_type: str | None, content_encoding: str | None,
         meta: Meta | None, final: bool) -> decision.Outcome:
    ready = _prepare(route, queue, body, content_type, content_encoding, meta, final)
    if isinstance(ready, decision.Outcome):
        return ready
    if ready.awaits:
        return awaiting.run(_call_async(ready))
    return _call(ready)


class _Call:
    """A message ready for its handler: decoded, admitted, validated; what the call needs and reports."""

    __slots__ = ("awaits", "body", "envelope", "event", "final", "meta", "payload", "queue", "route")

    def __init__(self, route: Route, queue: str, meta: Meta | None, body: bytes, envelope: Envelope | None,
                 payload: Any, event: Event[Any] | None, final: bool) -> None:
        self.route, self.queue, self.meta, self.body, self.envelope = route, queue, meta, body, envelope
        self.payload, self.event, self.final = payload, event, final
        self.awaits = route.awaits

    @property
    def argument(self) -> Any:
        return self.event if self.route.handler.bind else self.payload


def _prepare(route: Route, queue: str, body: bytes, content_type: str | None, content_encoding: str | None,
             meta: Meta | None, final: bool) -> _Call | decision.Outcome:
    """Admit, decompress, decode and validate the message: a call ready to make, or the Outcome that settles it."""
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
    event = None
    # Only a failure needs an Event for handler_failed (e.g. Sentry's receiver): built then, not per message.
    if handler.bind or route.hooks.on_handling or signals.handler_started.receivers or \
            signals.handler_succeeded.receivers:
        event = _event(payload, queue, meta, body, envelope)
    return _Call(route, queue, meta, body, envelope, payload, event, final)


def _call(call: _Call) -> decision.Outcome:
    """Call a sync handler (inside the middleware's ``handling()`` contexts); how it ended."""
    fn, hooks, event = call.route.handler.fn, call.route.hooks, call.event
    if event is not None and signals.handler_started.receivers:
        signals.handler_started.send(sender=fn, event=event)
    started = time.perf_counter()
    try:
        if event is not None and hooks.on_handling:  # time the handler, not the middleware around it
            started = hooks.around(event, partial(_timed, fn, call.argument))
        else:
            _ran(fn(call.argument))
    except Exception as exc:
        return _failed(call, exc, started)
    return _succeeded(call, started)


async def _call_async(call: _Call) -> decision.Outcome:
    """Await an ``async def`` handler (inside the ``handling()`` contexts, in its own task); how it ended."""
    fn, hooks, event = call.route.handler.fn, call.route.hooks, call.event
    if event is not None and signals.handler_started.receivers:
        signals.handler_started.send(sender=fn, event=event)
    started = time.perf_counter()
    try:
        if event is not None and hooks.on_handling:
            started = await awaiting.around(hooks, event, partial(_timed_async, fn, call.argument))
        else:
            await _awaited(fn(call.argument))
    except asyncio.CancelledError as exc:
        cancelled = awaiting.Cancelled(f"the handler was cancelled before it finished ({exc!r})")
        return _failed(call, cancelled, started)
    except Exception as exc:
        return _failed(call, exc, started)
    return _succeeded(call, started)


def _failed(call: _Call, exc: Exception, started: float) -> decision.Outcome:
    """The Outcome of a handler that raised ``exc``; ``handler_failed`` is sent."""
    handler, route = call.route.handler, call.route
    duration_ms = (time.perf_counter() - started) * 1000
    outcome = decision.classify(exc, retry_for=handler.retry_for, dont_retry=handler.dont_retry,
                                traceback_limit=route.traceback_limit, final=call.final, duration_ms=duration_ms)
    if signals.handler_failed.receivers:
        event = call.event
        if event is None:
            event = _event(call.payload, call.queue, call.meta, call.body, call.envelope)
        signals.handler_failed.send(sender=handler.fn, event=event, exception=exc, traceback=exc.__traceback__,
                                    duration_ms=duration_ms, outcome=outcome,
                                    action=decision.likely_action(outcome, final=call.final))
    return outcome


def _succeeded(call: _Call, started: float) -> decision.Outcome:
    duration_ms = (time.perf_counter() - started) * 1000
    if signals.handler_succeeded.receivers:
        signals.handler_succeeded.send(sender=call.route.handler.fn, event=call.event, duration_ms=duration_ms)
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


async def _timed_async(fn: Callable[[Any], Any], argument: Any) -> float:
    """Await ``fn(argument)``; return when it started."""
    started = time.perf_counter()
    await _awaited(fn(argument))
    return started


#: What a call returns when it did not run the body it was asked to (registration refuses generator functions;
#: a sync decorator around one gets through).
_NOT_RUN = (types.GeneratorType, types.AsyncGeneratorType)


def _ran(result: Any) -> None:
    """Make sure the body of a sync handler ran: await the coroutine a sync wrapper around an ``async def``
    function returns; raise Archive for a generator (never ack what did not run)."""
    if result is None:
        return
    if isinstance(result, types.CoroutineType):
        why = awaiting.refused()
        if why is None:
            awaiting.run(result)  # on this thread's loop, here: a sync handler's batch runs in order
            return
        result.close()  # no "never awaited" warning: the archive reason says it
        raise Archive(f"the handler returned a coroutine, which cannot be awaited here: {why}")
    if isinstance(result, _NOT_RUN):
        if not isinstance(result, types.AsyncGeneratorType):
            result.close()
        raise Archive(f"the handler returned a {type(result).__name__} instead of running: kombu-events "
                      f"cannot iterate it; make the handler a plain function")


async def _awaited(result: Any) -> None:
    """Await what an ``async def`` handler returned (an awaitable); anything else is a sync result (checked)."""
    if inspect.isawaitable(result):
        await result
    else:
        _ran(result)


#: A placeholder in run_batch's list until the gathered coroutines are done.
_NOT_AWAITED = decision.Outcome(decision.LOST, "not awaited")


def _event(payload: Any, queue: str, meta: Meta | None, body: bytes, envelope: Envelope | None = None) -> Event[Any]:
    """The Event a bound handler, a ``handling`` middleware or a pool signal gets."""
    routing_key, attempt, headers, properties = meta or ("", 0, {}, {})
    # Copies: under the solo and threads pools these are the delivery's own, which a retry or
    # archive copy is built from; what a handler changes must not leak into it.
    return Event(payload, routing_key, queue, attempt, dict(headers), dict(properties), body, envelope)
