"""``Middleware``: one place for metrics, tracing, breakers and test kits to see every message.

Subclass :class:`Middleware`, override the hooks you need, and register it with
``Events(app, service, middleware=[...])`` at import time (so forked pool processes
have it too). Hooks run in registration order; a hook that raises is logged and
skipped, and never changes how a message is settled.
"""
from __future__ import annotations

__all__ = ["Middleware", "Hooks", "Handled"]

import logging
import time
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping, TypeVar

from ..core.decision import Outcome
from ..errors import Archive, ConfigurationError, Retry

if TYPE_CHECKING:
    from ..core.delivery import Delivery
    from ..core.event import Event
    from ..core.settlement import Step
    from .control import Control

logger = logging.getLogger(__name__)

T = TypeVar("T")


class Handled(Exception):
    """Raised by a ``handling(event)`` context on entering: this event was handled before (the inbox holds its
    key), so the handler is not called and the message is acked (docs/effectively-once.md)."""


class Middleware:
    """Base class of middleware: every hook is a documented no-op.

    Main-process hooks: :meth:`started`, :meth:`received`, :meth:`before_dispatch`, :meth:`settled`,
    :meth:`stopped`, :meth:`before_publish`, :meth:`after_publish`, :meth:`after_store`. Pool-side hooks:
    :meth:`admit`, :meth:`handling`.
    """

    def started(self, control: Control) -> None:
        """The worker's events step started consuming this service (main process, on the event loop).

        Called again after every reconnect. ``control`` pauses and resumes the service's
        queues and sets timers (cancelled when the step stops): see :class:`~kombu_events.middleware.control.Control`.
        """

    def stopped(self, control: Control) -> None:
        """The step stopped consuming (connection lost, or the worker stops); its timers are cancelled."""

    def received(self, delivery: Delivery) -> None:
        """A message arrived on a handler queue (main process, on the event loop: be quick)."""

    def before_dispatch(self, delivery: Delivery) -> Outcome | None:
        """Return an Outcome to settle the message without running its handler (main process).

        E.g. ``Outcome(DEFERRED, "circuit open", delay_ms=5000)`` sends it back to its queue
        after 5 s without spending an attempt. The first middleware that returns one wins.
        """
        return None

    def admit(self, queue: str) -> Outcome | None:
        """Pool side, before a message of ``queue`` is decoded: an Outcome settles it without its handler.

        The pool-side twin of :meth:`before_dispatch`, for messages handed to the pool
        before the main process changed its mind (a circuit that opened meanwhile). It
        runs where handlers run, so it sees the main process's state only through what
        was shared before the pool forked. The first middleware that returns one wins.
        """
        return None

    def settled(self, delivery: Delivery, outcome: Outcome, step: Step) -> None:
        """The message is settled: ``step`` is what took effect (Ack, Republish or Hold) (main process)."""

    def before_publish(self, exchange: str, routing_key: str, properties: dict[str, Any]) -> None:
        """``events.publish`` is about to publish; ``properties["application_headers"]`` may be changed."""

    def after_publish(self, exchange: str, routing_key: str, properties: Mapping[str, Any],
                      error: Exception | None) -> None:
        """``events.publish`` finished: ``error`` is None once the broker confirmed the event.

        With a backlog, an event stored locally gets :meth:`after_store` instead, and
        ``after_publish`` later, when the flusher publishes it (in the process that flushes).
        """

    def after_store(self, exchange: str, routing_key: str, properties: Mapping[str, Any]) -> None:
        """``events.publish`` stored the event in the local backlog: the broker has not confirmed it yet."""

    def handling(self, event: Event) -> AbstractContextManager[Any]:
        """Context manager around one handler call, in the process that runs it (pool side).

        A context that fails on entering or leaving is logged and skipped, except three
        exceptions that steer the message: :class:`Handled` on entering skips the handler
        (the message is acked), ``Retry`` and ``Archive`` (entering, or leaving after the
        handler returned) end the attempt as if the handler had raised them.
        """
        return nullcontext()

    def handling_batch(self, events: list[Event]) -> AbstractContextManager[Any] | None:
        """Pool side, around one call of a batch handler (``batch=BatchOf(...)``) with ``events``.

        None (the default): the call runs inside this middleware's :meth:`handling` context of
        each event instead. A context's ``__enter__`` returns the indices (in ``events``) of
        events handled before, left out of the call and acked (the inbox's redeliveries), or
        None; on exit it sees the handler's exception, a ``BatchFailed`` naming failed events
        by their index in ``events``.
        """
        return None


def _overriding(middleware: tuple[Middleware, ...], hook: str) -> tuple[Middleware, ...]:
    base = getattr(Middleware, hook)
    return tuple(m for m in middleware if getattr(type(m), hook, base) is not base)


class Hooks:
    """The middleware of one service, grouped by hook: a hook nobody overrides costs nothing."""

    def __init__(self, middleware: Iterable[Middleware] = ()) -> None:
        self._group(tuple(middleware))

    def add(self, middleware: Middleware) -> None:
        """Append ``middleware`` after those already registered (e.g. the worker's own metrics).

        Call it before the pool forks, as for middleware given to ``Events``: every
        route of the service shares this object, so they all see it.
        """
        self._group((*self.middleware, middleware))

    def _group(self, middleware: tuple[Middleware, ...]) -> None:
        for m in middleware:
            if not isinstance(m, Middleware):
                raise ConfigurationError(f"middleware must be Middleware instances, got {m!r}")
        self.middleware = middleware
        self.on_started = _overriding(self.middleware, "started")
        self.on_stopped = _overriding(self.middleware, "stopped")
        self.on_received = _overriding(self.middleware, "received")
        self.on_before_dispatch = _overriding(self.middleware, "before_dispatch")
        self.on_admit = _overriding(self.middleware, "admit")
        self.on_settled = _overriding(self.middleware, "settled")
        self.on_before_publish = _overriding(self.middleware, "before_publish")
        self.on_after_publish = _overriding(self.middleware, "after_publish")
        self.on_after_store = _overriding(self.middleware, "after_store")
        self.on_handling = _overriding(self.middleware, "handling")

    def started(self, control: Control) -> None:
        for m in self.on_started:
            _guarded(m.started, control)

    def stopped(self, control: Control) -> None:
        for m in self.on_stopped:
            _guarded(m.stopped, control)

    def received(self, delivery: Delivery) -> None:
        for m in self.on_received:
            _guarded(m.received, delivery)

    def before_dispatch(self, delivery: Delivery) -> Outcome | None:
        return _first_outcome(self.on_before_dispatch, "before_dispatch", delivery)

    def admit(self, queue: str) -> Outcome | None:
        return _first_outcome(self.on_admit, "admit", queue)

    def settled(self, delivery: Delivery, outcome: Outcome, step: Step) -> None:
        for m in self.on_settled:
            _guarded(m.settled, delivery, outcome, step)

    def before_publish(self, exchange: str, routing_key: str, properties: dict[str, Any]) -> None:
        for m in self.on_before_publish:
            _guarded(m.before_publish, exchange, routing_key, properties)

    def after_publish(self, exchange: str, routing_key: str, properties: Mapping[str, Any],
                      error: Exception | None) -> None:
        for m in self.on_after_publish:
            _guarded(m.after_publish, exchange, routing_key, properties, error)

    def after_store(self, exchange: str, routing_key: str, properties: Mapping[str, Any]) -> None:
        for m in self.on_after_store:
            _guarded(m.after_store, exchange, routing_key, properties)

    def around(self, event: Event, call: Callable[[], T], skipped: Callable[[], Any] = time.perf_counter) -> T:
        """``call()`` inside every ``handling(event)`` context; a failing context is skipped.

        The handler's exception always propagates: a context manager cannot swallow it.
        A context raising :class:`Handled` on entering skips ``call`` and returns ``skipped()``
        (the runner's ``call`` returns when the handler started: a skipped one starts now);
        ``Retry`` or ``Archive`` from a context propagates, once the contexts entered are left.
        """
        entered = self.enter(event)
        if entered is None:
            return skipped()  # type: ignore[no-any-return]
        try:
            result = call()
        except BaseException as exc:
            self.leave(entered, exc)
            raise
        self.leave(entered, None)
        return result


    def enter(self, event: Event) -> list[AbstractContextManager[Any]] | None:
        """Enter every ``handling(event)`` context (the first half of :meth:`around`, for the async path too).

        Returns the contexts entered, or None when one raised :class:`Handled` (the handler is
        skipped; the others are left already). ``Retry`` or ``Archive`` propagates, the others left.
        """
        entered: list[AbstractContextManager[Any]] = []
        for m in self.on_handling:
            try:
                context = m.handling(event)
                context.__enter__()
                entered.append(context)
            except (Handled, Retry, Archive) as exc:
                _exit_all(entered, None, None, None)
                if isinstance(exc, Handled):
                    return None
                raise
            except Exception:
                logger.exception("kombu-events: middleware %r failed entering handling() for message %r of %s; "
                                 "skipped", m, event.message_id, event.queue)
        return entered

    @staticmethod
    def leave(entered: list[AbstractContextManager[Any]], exc: BaseException | None) -> None:
        """Leave the contexts :meth:`enter` entered, innermost first, after the handler raised ``exc`` (or None);
        a ``Retry`` or ``Archive`` raised by one on leaving after a success propagates."""
        if exc is not None:
            _exit_all(entered, type(exc), exc, exc.__traceback__)
            return
        steering = _exit_all(entered, None, None, None)
        if steering is not None:
            raise steering


def _first_outcome(middleware: tuple[Middleware, ...], hook: str, argument: Any) -> Outcome | None:
    """The first Outcome that ``hook`` of ``middleware`` returns, or None."""
    for m in middleware:
        outcome = _guarded(getattr(m, hook), argument)
        if isinstance(outcome, Outcome):
            return outcome
        if outcome is not None:
            logger.error("kombu-events: %r.%s returned %r, not an Outcome or None%s; ignored", m, hook, outcome,
                         _about(hook, (argument,)))
    return None


def _exit_all(entered: list[AbstractContextManager[Any]], *exc_info: Any) -> Exception | None:
    """Leave every context, innermost first; return the first ``Retry``/``Archive`` one raised (others are logged)."""
    steering: Exception | None = None
    for context in reversed(entered):
        try:
            context.__exit__(*exc_info)
        except (Retry, Archive) as exc:  # e.g. the inbox could not commit: the attempt must not count as done
            steering = steering or exc
        except Exception:
            logger.exception("kombu-events: middleware context %r failed on exit; ignored", context)
    return steering


def _guarded(hook: Callable[..., T], *args: Any) -> T | None:
    """``hook(*args)``; an exception is logged with what the hook was called about, and gives None."""
    try:
        return hook(*args)
    except Exception:
        logger.exception("kombu-events: middleware hook %s failed%s; skipped", getattr(hook, "__qualname__", hook),
                         _about(getattr(hook, "__name__", ""), args))
        return None


def _about(hook: str, args: tuple[Any, ...]) -> str:
    """`` for message ... of <queue>`` (or the service, queue or event) for the log line of a failing hook."""
    first = args[0] if args else None
    if hook in ("received", "before_dispatch", "settled"):
        return f" for message {getattr(first, 'message_id', None)!r} of {getattr(first, 'queue', '?')}"
    if hook in ("started", "stopped"):
        return f" for service {getattr(first, 'service', '?')}"
    if hook == "admit":
        return f" for a message of {first}"
    if hook in ("before_publish", "after_publish", "after_store") and len(args) >= 3:
        properties = args[2] if isinstance(args[2], Mapping) else {}
        return f" for event {args[1]!r} to exchange {args[0]!r} (message id {properties.get('message_id')!r})"
    return ""
