"""``Middleware``: one place for metrics, tracing, breakers and test kits to see every message.

Subclass :class:`Middleware`, override the hooks you need, and register it with
``Events(app, service, middleware=[...])`` at import time (so forked pool processes
have it too). Hooks run in registration order; a hook that raises is logged and
skipped, and never changes how a message is settled.
"""
from __future__ import annotations

__all__ = ["Middleware", "Hooks"]

import logging
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping, TypeVar

from .decision import Outcome
from .errors import ConfigurationError

if TYPE_CHECKING:
    from .delivery import Delivery
    from .event import Event
    from .plan import Step

logger = logging.getLogger(__name__)

T = TypeVar("T")


class Middleware:
    """Base class of middleware: every hook is a documented no-op.

    Main-process hooks: :meth:`received`, :meth:`before_dispatch`, :meth:`settled`,
    :meth:`before_publish`, :meth:`after_publish`. Pool-side hook: :meth:`handling`.
    """

    def received(self, delivery: Delivery) -> None:
        """A message arrived on a handler queue (main process, on the event loop: be quick)."""

    def before_dispatch(self, delivery: Delivery) -> Outcome | None:
        """Return an Outcome to settle the message without running its handler (main process).

        E.g. ``Outcome(DEFERRED, "circuit open", delay_ms=5000)`` sends it back to its queue
        after 5 s without spending an attempt. The first middleware that returns one wins.
        """
        return None

    def settled(self, delivery: Delivery, outcome: Outcome, step: Step) -> None:
        """The message is settled: ``step`` is what took effect (Ack, Republish or Hold) (main process)."""

    def before_publish(self, exchange: str, routing_key: str, properties: dict[str, Any]) -> None:
        """``events.publish`` is about to publish; ``properties["application_headers"]`` may be changed."""

    def after_publish(self, exchange: str, routing_key: str, properties: Mapping[str, Any],
                      error: Exception | None) -> None:
        """``events.publish`` finished: ``error`` is None once the broker confirmed the event."""

    def handling(self, event: Event) -> AbstractContextManager[Any]:
        """Context manager around one handler call, in the process that runs it (pool side)."""
        return nullcontext()


def _overriding(middleware: tuple[Middleware, ...], hook: str) -> tuple[Middleware, ...]:
    base = getattr(Middleware, hook)
    return tuple(m for m in middleware if getattr(type(m), hook, base) is not base)


class Hooks:
    """The middleware of one service, grouped by hook: a hook nobody overrides costs nothing."""

    def __init__(self, middleware: Iterable[Middleware] = ()) -> None:
        self.middleware = tuple(middleware)
        for m in self.middleware:
            if not isinstance(m, Middleware):
                raise ConfigurationError(f"middleware must be Middleware instances, got {m!r}")
        self.on_received = _overriding(self.middleware, "received")
        self.on_before_dispatch = _overriding(self.middleware, "before_dispatch")
        self.on_settled = _overriding(self.middleware, "settled")
        self.on_before_publish = _overriding(self.middleware, "before_publish")
        self.on_after_publish = _overriding(self.middleware, "after_publish")
        self.on_handling = _overriding(self.middleware, "handling")

    def received(self, delivery: Delivery) -> None:
        for m in self.on_received:
            _guarded(m.received, delivery)

    def before_dispatch(self, delivery: Delivery) -> Outcome | None:
        for m in self.on_before_dispatch:
            outcome = _guarded(m.before_dispatch, delivery)
            if isinstance(outcome, Outcome):
                return outcome
            if outcome is not None:
                logger.error("kombu-events: %r.before_dispatch returned %r, not an Outcome or None; ignored",
                             m, outcome)
        return None

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

    def around(self, event: Event, call: Callable[[], T]) -> T:
        """``call()`` inside every ``handling(event)`` context; a failing context is skipped.

        The handler's exception always propagates: a context manager cannot swallow it.
        """
        entered = []
        for m in self.on_handling:
            try:
                context = m.handling(event)
                context.__enter__()
                entered.append(context)
            except Exception:
                logger.exception("kombu-events: middleware %r failed entering handling(); skipped", m)
        try:
            result = call()
        except BaseException as exc:
            _exit_all(entered, type(exc), exc, exc.__traceback__)
            raise
        _exit_all(entered, None, None, None)
        return result


def _exit_all(entered: list[AbstractContextManager[Any]], *exc_info: Any) -> None:
    for context in reversed(entered):
        try:
            context.__exit__(*exc_info)
        except Exception:
            logger.exception("kombu-events: middleware context %r failed on exit; ignored", context)


def _guarded(hook: Callable[..., T], *args: Any) -> T | None:
    try:
        return hook(*args)
    except Exception:
        logger.exception("kombu-events: middleware hook %s failed; skipped", getattr(hook, "__qualname__", hook))
        return None
