"""OpenTelemetry tracing: a CONSUMER span per handler call, a PRODUCER span per ``events.publish``.

``pip install kombu-events[opentelemetry]``, then register the middleware::

    events = Events(app, service="billing", middleware=[TracingMiddleware()])

The publisher's trace context travels in the ``traceparent``/``tracestate`` headers
(the global propagator, W3C trace context by default). Retries and archive replays
keep the publisher's headers, so every attempt of a message is a child of the same
producer span: one trace per message, however often it is retried or replayed.
Span attributes follow OpenTelemetry's messaging semantic conventions for RabbitMQ.
"""
from __future__ import annotations

__all__ = ["TracingMiddleware", "consumer_attributes", "producer_attributes", "error_type", "ATTEMPT"]

import logging
from contextlib import AbstractContextManager
from typing import Any, Mapping

try:
    from opentelemetry import context as otel_context, propagate, trace
    from opentelemetry.context import Context
    from opentelemetry.trace import Span, SpanKind, Status, StatusCode
except ImportError as exc:  # pragma: no cover - the extra is not installed
    raise ImportError(f"kombu_events.tracing needs opentelemetry-api: pip install 'kombu-events[opentelemetry]' "
                      f"({exc})") from exc

from .. import registry
from ..core.event import Event
from ..middleware.base import Middleware
from ..version import __version__

logger = logging.getLogger(__name__)

#: The attempt number (1-based) of the delivery a CONSUMER span handled; not a semantic convention.
ATTEMPT = "kombu_events.attempt"

#: PRODUCER spans waiting for their ``after_publish`` at most (one that never comes must not leak).
MAX_PUBLISHING = 10_000


def _destination(*parts: str) -> str:
    """Non-empty parts joined by ``:``, a part equal to the one before left out (semconv for RabbitMQ)."""
    kept: list[str] = []
    for part in parts:
        if part and (not kept or kept[-1] != part):
            kept.append(part)
    return ":".join(kept)


def _message_attributes(properties: Mapping[str, Any]) -> dict[str, str]:
    found = {}
    if properties.get("message_id") is not None:
        found["messaging.message.id"] = str(properties["message_id"])
    if properties.get("correlation_id") is not None:
        found["messaging.message.conversation_id"] = str(properties["correlation_id"])
    return found


def consumer_attributes(event: Event, exchange: str) -> dict[str, Any]:
    """Attributes of the CONSUMER span of one handler call (``exchange``: the service's events exchange)."""
    attributes: dict[str, Any] = {
        "messaging.system": "rabbitmq",
        "messaging.operation.type": "process",
        "messaging.operation.name": "process",
        "messaging.destination.name": _destination(exchange, event.routing_key, event.queue),
        "messaging.rabbitmq.destination.routing_key": event.routing_key,
        ATTEMPT: event.attempt,
    }
    attributes.update(_message_attributes(event.properties))
    return attributes


def producer_attributes(exchange: str, routing_key: str, properties: Mapping[str, Any]) -> dict[str, Any]:
    """Attributes of the PRODUCER span of one published event."""
    attributes: dict[str, Any] = {
        "messaging.system": "rabbitmq",
        "messaging.operation.type": "send",
        "messaging.operation.name": "publish",
        "messaging.destination.name": _destination(exchange, routing_key) or "amq.default",
        "messaging.rabbitmq.destination.routing_key": routing_key,
    }
    attributes.update(_message_attributes(properties))
    return attributes


def error_type(exc: BaseException) -> str:
    """``error.type``: the exception's class, with its module unless it is a builtin (``ValueError``)."""
    cls = type(exc)
    return cls.__qualname__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"


def _text_headers(headers: Mapping[str, Any] | None) -> dict[str, str]:
    """The headers a propagator can read: text values (bytes from other clients decoded)."""
    carrier = {}
    for key, value in (headers or {}).items():
        if isinstance(value, bytes):
            value = value.decode("utf-8", "replace")
        if isinstance(key, str) and isinstance(value, str):
            carrier[key] = value
    return carrier


class _Processing:
    """The span of one handler call, current while it runs (with the publisher's baggage, if any).

    A plain class rather than ``start_as_current_span``: it runs once per message, and
    the SDK's nested context managers cost more than the span itself.
    """

    __slots__ = ("event", "exchange", "span", "token", "tracer")

    def __init__(self, tracer: trace.Tracer, event: Event, exchange: str) -> None:
        self.tracer, self.event, self.exchange = tracer, event, exchange

    def __enter__(self) -> Span:
        event = self.event
        carrier = _text_headers(event.headers)
        parent = propagate.extract(carrier) if carrier else None
        self.span = self.tracer.start_span(f"process {event.queue}", context=parent, kind=SpanKind.CONSUMER,
                                           attributes=consumer_attributes(event, self.exchange),
                                           record_exception=False, set_status_on_exception=False)
        self.token = otel_context.attach(trace.set_span_in_context(self.span, parent))
        return self.span

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: Any) -> None:
        otel_context.detach(self.token)
        if exc is not None:
            _failed(self.span, exc)
        self.span.end()


def _failed(span: Span, exc: BaseException) -> None:
    span.set_attribute("error.type", error_type(exc))
    span.record_exception(exc)
    span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))


class TracingMiddleware(Middleware):
    """Spans for handler calls (pool side) and ``events.publish`` (publishing process), context in headers.

    ``tracer_provider``: where spans go (default: the global one, set by your
    OpenTelemetry SDK set-up). ``publish_spans=False`` injects the current context
    into published events without a PRODUCER span of their own.
    """

    def __init__(self, tracer_provider: trace.TracerProvider | None = None, *, publish_spans: bool = True) -> None:
        self.tracer = trace.get_tracer("kombu_events", __version__, tracer_provider)
        self.publish_spans = publish_spans
        self._exchanges: dict[str, str] = {}
        self._publishing: dict[int, Span] = {}  # by id() of the properties, from before_ to after_publish

    def handling(self, event: Event) -> AbstractContextManager[Any]:
        """A CONSUMER span ``process <queue>`` around the handler, child of the publisher's context."""
        return _Processing(self.tracer, event, self._exchange_of(event.queue))

    def before_publish(self, exchange: str, routing_key: str, properties: dict[str, Any]) -> None:
        """Start the PRODUCER span and write its context into the event's headers."""
        headers = properties.get("application_headers")
        if headers is None:
            headers = properties["application_headers"] = {}
        # Headers that already carry a context (an event forwarded on someone's behalf) keep their trace.
        parent: Context | None = propagate.extract(_text_headers(headers)) if "traceparent" in headers else None
        if not self.publish_spans:
            propagate.inject(headers, context=parent)
            return
        span = self.tracer.start_span(f"publish {exchange}", context=parent, kind=SpanKind.PRODUCER,
                                      attributes=producer_attributes(exchange, routing_key, properties))
        propagate.inject(headers, context=trace.set_span_in_context(span))
        if len(self._publishing) >= MAX_PUBLISHING:
            logger.warning("kombu-events: %d publish spans never ended (no after_publish); dropped them",
                           len(self._publishing))
            self._publishing.clear()
        self._publishing[id(properties)] = span

    def after_publish(self, exchange: str, routing_key: str, properties: Mapping[str, Any],
                      error: Exception | None) -> None:
        """End the PRODUCER span: an error when the broker did not take the event."""
        span = self._publishing.pop(id(properties), None)
        if span is None:
            return
        if error is not None:
            _failed(span, error)
        span.end()

    def _exchange_of(self, queue: str) -> str:
        """The events exchange of the service that owns ``queue`` ('' if no service here has it)."""
        exchange = self._exchanges.get(queue)
        if exchange is None:
            exchange = ""
            for events in registry.services:
                try:
                    if any(h.queue == queue for h in events.handlers):
                        exchange = events.settings.exchange
                        break
                except Exception as exc:  # another service's bad configuration is not this span's problem
                    logger.debug("kombu-events: skipped %r looking up the exchange of %s: %s", events, queue, exc)
            self._exchanges[queue] = exchange
        return exchange
