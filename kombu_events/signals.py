"""Signals sent for every event message, built on Celery's ``Signal`` (never Celery's own ``task_*``).

Connect a receiver with ``@handler_failed.connect`` (any sender) or
``@handler_failed.connect(sender=my_handler_function)``. A receiver that raises is
logged by Celery's dispatcher and never breaks a message. Receivers run where the
signal is sent: the pool signals in the process that runs handlers (a prefork
child: connect them at import time of the app, before the pool forks), the others
in the worker's main process.

Celery's ``task_*`` signals are left alone on purpose: Sentry's and OpenTelemetry's
Celery integrations read task attributes from their sender, which a handler has not.
"""
from __future__ import annotations

__all__ = ["TypedSignal", "handler_started", "handler_succeeded", "handler_failed", "message_settled",
           "event_published", "event_stored", "circuit_changed"]

from typing import Any, Callable, Protocol, TypeVar, overload

from celery.utils.dispatch import Signal

F = TypeVar("F", bound=Callable[..., Any])


class TypedSignal(Protocol):
    """The part of Celery's ``Signal`` used with these signals, typed for users' type checkers."""

    name: str
    receivers: list[Any]

    @overload
    def connect(self, receiver: F) -> F: ...

    @overload
    def connect(self, *, sender: Any = None, weak: bool = True, dispatch_uid: Any = None) -> Callable[[F], F]: ...

    def connect(self, *args: Any, **kwargs: Any) -> Any:
        """Connect a receiver: ``@signal.connect`` or ``@signal.connect(sender=handler_function)``."""

    def disconnect(self, receiver: Any = None, sender: Any = None, weak: Any = None,
                   dispatch_uid: Any = None) -> bool:
        """Disconnect a receiver."""

    def send(self, sender: Any, **named: Any) -> list[tuple[Any, Any]]:
        """Call every connected receiver; one that raises is logged, its exception returned."""

#: Pool side, before a handler runs. sender: the handler function; ``event``: the :class:`~kombu_events.Event`.
handler_started: TypedSignal = Signal(name="handler_started", providing_args={"event"})

#: Pool side, after a handler returned. Adds ``duration_ms``: the handler's own run time.
handler_succeeded: TypedSignal = Signal(name="handler_succeeded", providing_args={"event", "duration_ms"})

#: Pool side, after a handler raised. Adds ``exception`` (the exception object), ``traceback``
#: (its traceback object), ``duration_ms``, ``outcome`` (the :class:`~kombu_events.core.decision.Outcome`
#: the attempt ended with) and ``action``: ``retry`` or ``archive``, what the worker will most likely
#: do with the message (:func:`~kombu_events.core.decision.likely_action`; ``message_settled`` tells what it did).
handler_failed: TypedSignal = Signal(name="handler_failed",
                                     providing_args={"event", "exception", "traceback", "duration_ms", "outcome",
                                                     "action"})

#: Main process, once a message is settled. sender: the handler function. Arguments: ``queue``,
#: ``routing_key``, ``message_id``, ``attempt``, ``action`` (ack, retry, requeue, archive or
#: held), ``delay_ms`` (retry and requeue), ``reason``, ``handler_duration_ms`` (0 if the handler
#: did not run), ``outcome`` (the :class:`~kombu_events.core.decision.Outcome`).
message_settled: TypedSignal = Signal(name="message_settled", providing_args={
    "queue", "routing_key", "message_id", "attempt", "action", "delay_ms", "reason", "handler_duration_ms",
    "outcome"})

#: Where ``events.publish``/``publish_many`` run, once per event. sender: the ``Events``. Arguments:
#: ``exchange``, ``routing_key``, ``message_id``, ``properties``, ``error`` (None once confirmed). With a
#: backlog, an event stored locally sends ``event_stored`` instead, and this one when the flusher
#: publishes it (in the process that flushes).
event_published: TypedSignal = Signal(name="event_published", providing_args={
    "exchange", "routing_key", "message_id", "properties", "error"})

#: With a backlog, where ``events.publish``/``publish_many`` run, once per event stored locally (not
#: yet confirmed; ``event_published`` follows when the flusher publishes it). sender: the ``Events``.
#: Arguments: ``exchange``, ``routing_key``, ``message_id``, ``properties``.
event_stored: TypedSignal = Signal(name="event_stored", providing_args={
    "exchange", "routing_key", "message_id", "properties"})

#: Main process, when a handler's circuit breaker changes state. sender: the handler function.
#: Arguments: ``queue``, ``state`` (closed, open or half_open), ``previous``, ``reason``.
circuit_changed: TypedSignal = Signal(name="circuit_changed", providing_args={"queue", "state", "previous", "reason"})
