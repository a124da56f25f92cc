"""integrations/tracing.py: spans with the SDK's in-memory exporter, through the worker's own code (the
stub), no socket.
"""
from __future__ import annotations

import celery
import pytest
from opentelemetry import baggage, trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from kombu_events import Constant, Events, PublishError
from kombu_events.core import wire
from kombu_events.core.event import Event
from kombu_events.integrations.tracing import (
    TracingMiddleware,
    consumer_attributes,
    error_type,
    producer_attributes,
)
from kombu_events.testing import StubEvents

PARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


class PaymentDeclined(Exception):
    pass


@pytest.fixture
def exporter():
    return InMemorySpanExporter()


@pytest.fixture
def tracing(exporter):
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return TracingMiddleware(provider)


@pytest.fixture
def events(tracing, monkeypatch):
    monkeypatch.delenv("AMQP_EVENTS_MAX_RETRIES", raising=False)
    app = celery.Celery("proj", broker="memory://", set_as_current=False)
    return Events(app, "billing", exchange="shop", delay_unit_ms=100, delay_levels=8, middleware=[tracing])


def _spans(exporter, kind):
    return [s for s in exporter.get_finished_spans() if s.kind is kind]


def test_consumer_attributes_follow_the_rabbitmq_conventions():
    event = Event({}, "orders.7.created", "billing.charge", 3, {}, {"message_id": "m-1", "correlation_id": "c-9"})
    assert consumer_attributes(event, "shop") == {
        "messaging.system": "rabbitmq",
        "messaging.operation.type": "process",
        "messaging.operation.name": "process",
        "messaging.destination.name": "shop:orders.7.created:billing.charge",
        "messaging.rabbitmq.destination.routing_key": "orders.7.created",
        "messaging.message.id": "m-1",
        "messaging.message.conversation_id": "c-9",
        "kombu_events.attempt": 3,
    }


@pytest.mark.parametrize("exchange, routing_key, destination", [
    ("shop", "orders.7.created", "shop:orders.7.created"), ("", "jobs", "jobs"), ("shop", "", "shop"),
    ("", "", "amq.default"),
])
def test_producer_attributes_name_the_destination_from_what_is_not_empty(exchange, routing_key, destination):
    attributes = producer_attributes(exchange, routing_key, {"message_id": "m-1"})
    assert attributes["messaging.destination.name"] == destination
    assert attributes["messaging.operation.type"] == "send" and attributes["messaging.message.id"] == "m-1"
    assert "messaging.message.conversation_id" not in attributes


def test_a_consumer_destination_names_routing_key_and_queue_once_when_they_are_equal():
    event = Event({}, "jobs", "jobs", 1)
    assert consumer_attributes(event, "")["messaging.destination.name"] == "jobs"


@pytest.mark.parametrize("exc, name", [(ValueError("x"), "ValueError"),
                                       (PaymentDeclined(), f"{__name__}.PaymentDeclined")])
def test_error_type_is_the_exception_class(exc, name):
    assert error_type(exc) == name


def test_every_attempt_and_a_replay_are_children_of_the_publishers_span(events, exporter):
    succeed = []

    @events.handler("orders.*.created", max_retries=1, backoff=Constant(every_ms=100))
    def charge(payload):
        if not succeed:
            raise PaymentDeclined("card declined")

    stub = StubEvents(events)
    with stub:
        message_id = events.publish("orders.7.created", {"order_id": 7}, correlation_id="c-9")
    stub.join(fail_fast=False)
    stub.advance(1, fail_fast=False)
    assert [(s.action, s.attempt) for s in stub.settled] == [("retry", 1), ("archive", 2)]
    succeed.append(True)
    replayed = wire.replay_headers(stub.archived[0].headers)  # what `kombu-events archive replay` sends
    stub.publish("orders.7.created", {"order_id": 7}, headers=replayed, message_id=message_id,
                 correlation_id="c-9")
    stub.join()

    (producer,) = _spans(exporter, SpanKind.PRODUCER)
    attempts = _spans(exporter, SpanKind.CONSUMER)
    assert producer.name == "publish shop"
    assert producer.attributes["messaging.destination.name"] == "shop:orders.7.created"
    assert [s.name for s in attempts] == ["process billing.charge"] * 3
    assert {s.context.trace_id for s in attempts} == {producer.context.trace_id}
    assert {s.parent.span_id for s in attempts} == {producer.context.span_id}
    assert [s.attributes["kombu_events.attempt"] for s in attempts] == [1, 2, 1]
    assert [s.attributes.get("error.type") for s in attempts] == [f"{__name__}.PaymentDeclined"] * 2 + [None]
    assert [s.status.status_code for s in attempts] == [StatusCode.ERROR] * 2 + [StatusCode.UNSET]
    assert [e.name for e in attempts[0].events] == ["exception"]
    assert all(s.attributes["messaging.message.id"] == message_id for s in attempts)
    assert all(s.attributes["messaging.message.conversation_id"] == "c-9" for s in attempts)


def test_a_handler_publishing_an_event_continues_the_trace(events, exporter):
    @events.handler("orders.*.created")
    def charge(payload):
        events.publish("billing.invoice.paid", {"order_id": payload["order_id"]})

    @events.handler("billing.#")
    def notify(payload):
        pass

    stub = StubEvents(events)
    with stub:
        events.publish("orders.7.created", {"order_id": 7})
        stub.join()
    spans = {s.name: s for s in exporter.get_finished_spans()}
    first, second = _spans(exporter, SpanKind.PRODUCER)
    charged, notified = (spans[f"process billing.{name}"] for name in ("charge", "notify"))
    assert charged.parent.span_id == first.context.span_id
    assert second.parent.span_id == charged.context.span_id
    assert notified.parent.span_id == second.context.span_id
    assert len({s.context.trace_id for s in exporter.get_finished_spans()}) == 1


def test_an_event_without_trace_headers_starts_a_trace_of_its_own(events, exporter):
    @events.handler("orders.#")
    def charge(payload):
        pass

    stub = StubEvents(events)
    stub.publish("orders.1", {}, headers={"traceparent": b"garbage"})  # not a context: ignored
    stub.publish("orders.2", {})
    stub.join()
    spans = _spans(exporter, SpanKind.CONSUMER)
    assert len(spans) == 2 and all(s.parent is None for s in spans)
    assert spans[0].context.trace_id != spans[1].context.trace_id


def test_a_context_sent_as_bytes_by_another_client_is_read(events, exporter):
    @events.handler("orders.#")
    def charge(payload):
        pass

    stub = StubEvents(events)
    stub.publish("orders.1", {}, headers={"traceparent": PARENT.encode()})
    stub.join()
    (span,) = _spans(exporter, SpanKind.CONSUMER)
    assert format(span.context.trace_id, "032x") == PARENT.split("-")[1]
    assert format(span.parent.span_id, "016x") == PARENT.split("-")[2]


def test_publishing_with_a_context_in_the_headers_keeps_that_trace(tracing, exporter):
    properties = {"message_id": "m-1", "application_headers": {"traceparent": PARENT}}
    tracing.before_publish("shop", "orders.1", properties)
    tracing.after_publish("shop", "orders.1", properties, None)
    (span,) = exporter.get_finished_spans()
    assert format(span.parent.span_id, "016x") == PARENT.split("-")[2]
    assert properties["application_headers"]["traceparent"].split("-")[2] == format(span.context.span_id, "016x")


def test_a_refused_publish_ends_its_span_with_the_error(tracing, exporter):
    properties = {"message_id": "m-1", "application_headers": None}
    tracing.before_publish("shop", "orders.1", properties)
    assert "traceparent" in properties["application_headers"]
    tracing.after_publish("shop", "orders.1", properties, PublishError("nacked"))
    (span,) = exporter.get_finished_spans()
    assert span.status.status_code is StatusCode.ERROR
    assert span.attributes["error.type"] == "kombu_events.errors.PublishError"
    assert not tracing._publishing


def test_without_publish_spans_the_current_context_is_injected(exporter):
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing = TracingMiddleware(provider, publish_spans=False)
    with provider.get_tracer("test").start_as_current_span("request") as request:
        properties = {"application_headers": {}}
        tracing.before_publish("shop", "orders.1", properties)
        tracing.after_publish("shop", "orders.1", properties, None)
    assert [s.name for s in exporter.get_finished_spans()] == ["request"]
    assert properties["application_headers"]["traceparent"].split("-")[2] == format(request.context.span_id, "016x")
    assert trace.get_current_span() is trace.INVALID_SPAN


def test_the_handler_runs_in_its_span_with_the_publishers_baggage(events, exporter):
    seen = []

    @events.handler("orders.#")
    def charge(payload):
        seen.append((trace.get_current_span().get_span_context().span_id, baggage.get_baggage("tenant")))

    stub = StubEvents(events)
    stub.publish("orders.1", {}, headers={"traceparent": PARENT, "baggage": "tenant=acme"})
    stub.join()
    (span,) = _spans(exporter, SpanKind.CONSUMER)
    assert seen == [(span.context.span_id, "acme")]
    assert trace.get_current_span() is trace.INVALID_SPAN and baggage.get_baggage("tenant") is None


def test_publish_spans_that_never_end_do_not_pile_up(tracing, monkeypatch, caplog):
    monkeypatch.setattr("kombu_events.integrations.tracing.MAX_PUBLISHING", 3)
    kept = [{"application_headers": {}} for _ in range(4)]  # alive, so that no id() is reused
    for properties in kept:
        tracing.before_publish("shop", "orders.1", properties)
    assert len(tracing._publishing) == 1 and "3 publish spans never ended" in caplog.text


def test_a_delayed_event_is_handled_in_its_publishers_trace(events, exporter):
    @events.handler("orders.#")
    def charge(payload):
        pass

    stub = StubEvents(events)
    with stub:
        events.publish("orders.1", {}, delay=5)
    stub.advance(5)
    (producer,) = _spans(exporter, SpanKind.PRODUCER)
    (span,) = _spans(exporter, SpanKind.CONSUMER)
    assert producer.name.startswith("publish shop.")  # the exchange's ladder
    assert span.parent.span_id == producer.context.span_id
    assert span.attributes["messaging.rabbitmq.destination.routing_key"] == "orders.1"
