"""integrations/sentry.py: handler errors captured by a real sentry_sdk client whose transport keeps
the envelopes (no socket).
"""
from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import ClassVar

import celery
import pytest
import sentry_sdk
from sentry_sdk.transport import Transport

from kombu_events import Archive, Events, Retry, poisonous, signals
from kombu_events.broker import lenient_amqp as wire_guard
from kombu_events.core.event import Event
from kombu_events.integrations import sentry
from kombu_events.testing import StubEvents
from kombu_events.worker.bootstep import EventsStep


class Captured(Transport):
    """A transport that keeps what would be sent to Sentry."""

    envelopes: ClassVar[list] = []

    def capture_envelope(self, envelope):
        self.envelopes.append(envelope)


def _events_sent():
    return [item.payload.json for envelope in Captured.envelopes for item in envelope.items if item.type == "event"]


@pytest.fixture
def initialised():
    Captured.envelopes = []
    sentry_sdk.init(dsn="https://public@sentry.example/1", transport=Captured, default_integrations=False,
                    auto_enabling_integrations=False)
    yield
    sentry_sdk.get_client().close()
    sentry_sdk.get_global_scope().set_client(None)


@pytest.fixture
def connected():
    sentry.connect()
    yield
    sentry.disconnect()
    sentry._state["disabled"] = False
    assert not signals.handler_failed.receivers


@pytest.fixture
def events(monkeypatch):
    monkeypatch.delenv("AMQP_EVENTS_MAX_RETRIES", raising=False)
    app = celery.Celery("proj", broker="memory://", set_as_current=False)
    return Events(app, "billing", delay_unit_ms=100, delay_levels=8, max_retries=1)


def test_tags_are_cut_to_sentrys_length():
    event = Event({}, "o." * 150, "billing.charge", 2)
    assert sentry.tags(event, "retry") == {"kombu_events.queue": "billing.charge",
                                           "kombu_events.routing_key": ("o." * 150)[:200],
                                           "kombu_events.attempt": "2", "kombu_events.outcome": "retry"}


def test_a_failed_attempt_reaches_sentry_with_its_tags(initialised, connected, events):
    @events.handler("orders.*.created")
    def charge(payload):
        raise ConnectionError("payment service down")

    stub = StubEvents(events)
    message_id = stub.publish("orders.7.created", {"order_id": 7})
    stub.join(fail_fast=False)
    stub.advance(10, fail_fast=False)
    assert [s.action for s in stub.settled] == ["retry", "archive"]
    sent = _events_sent()
    assert [e["tags"]["kombu_events.outcome"] for e in sent] == ["retry", "archive"]
    assert [e["tags"]["kombu_events.attempt"] for e in sent] == ["1", "2"]
    assert {e["tags"]["kombu_events.queue"] for e in sent} == {"billing.charge"}
    assert {e["tags"]["kombu_events.routing_key"] for e in sent} == {"orders.7.created"}
    assert {e["exception"]["values"][-1]["type"] for e in sent} == {"ConnectionError"}
    assert sent[0]["contexts"]["kombu_events"]["message_id"] == message_id
    assert sent[0]["contexts"]["kombu_events"]["handler"].endswith("charge")


def test_the_handlers_own_steering_is_not_reported_but_a_poisonous_failure_is(initialised, connected, events):
    @events.handler("orders.#", max_retries=3)
    def charge(payload):
        if payload["how"] == "retry":
            raise Retry(1)
        if payload["how"] == "archive":
            raise Archive("not ours")
        with poisonous():
            raise KeyError("order_id")

    stub = StubEvents(events)
    for how in ("retry", "archive", "poison"):
        stub.publish("orders.1", {"how": how})
    stub.join(fail_fast=False)
    assert sorted(s.action for s in stub.settled) == ["archive", "archive", "retry"]
    (sent,) = _events_sent()
    assert sent["tags"]["kombu_events.outcome"] == "archive"
    assert [v["type"] for v in sent["exception"]["values"]] == ["KeyError", "Poisoned"]


def test_nothing_is_sent_before_sentry_sdk_is_initialised(connected, events):
    Captured.envelopes = []

    @events.handler("orders.#", max_retries=0)
    def charge(payload):
        raise ValueError("boom")

    stub = StubEvents(events)
    stub.publish("orders.1", {})
    stub.join(fail_fast=False)
    assert [s.action for s in stub.archived] == ["archive"] and Captured.envelopes == []


def test_the_worker_connects_it_unless_the_app_turned_it_off():
    try:
        assert sentry.install() is True and signals.handler_failed.receivers
        assert sentry.install() is False, "connected already"
        sentry.uninstall()
        assert not signals.handler_failed.receivers
        sentry.disconnect()
        assert sentry.install() is False and not signals.handler_failed.receivers
    finally:
        sentry.disconnect()
        sentry._state["disabled"] = False


def test_a_worker_in_a_tests_thread_leaves_no_receiver_behind(monkeypatch):
    monkeypatch.setattr(wire_guard, "install", lambda: None)  # py-amqp's decoders stay as they are
    app = celery.Celery("proj", broker="memory://", set_as_current=False)
    Events(app, "billing")
    parent = SimpleNamespace(app=app)
    step = EventsStep(parent, with_events_step=True)
    assert signals.handler_failed.receivers
    step.shutdown(parent)
    assert not signals.handler_failed.receivers


def test_a_sentry_sdk_that_raises_is_logged_with_the_handler_and_message_and_goes_no_further(initialised, monkeypatch,
                                                                                             caplog):
    def broken(exception):
        raise RuntimeError("transport broke")

    monkeypatch.setattr(sentry_sdk, "capture_exception", broken)
    event = Event({}, "orders.1", "billing.charge", 2, properties={"message_id": "m-1"})
    with caplog.at_level(logging.ERROR, logger="kombu_events.integrations.sentry"):
        sentry.report(sender=test_tags_are_cut_to_sentrys_length, event=event, exception=ValueError("boom"),
                      action="retry")
    (record,) = caplog.records
    assert record.getMessage() == ("kombu-events: reporting the error of handler test_tags_are_cut_to_sentrys_length "
                                   "(queue billing.charge, message 'm-1') to Sentry failed")
    assert record.exc_info[1].args == ("transport broke",)


def test_a_payload_that_does_not_fit_its_contract_is_reported():
    from kombu_events.errors import InvalidPayload
    from kombu_events.integrations.sentry import _reported

    assert _reported(InvalidPayload("Order", [("amount", "Input should be a valid number", "'ten'")]))
