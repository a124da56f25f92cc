"""``publish(..., delay=...)``: where it goes, what it carries, what is refused (no socket: the stub)."""
from __future__ import annotations

import pytest

from kombu_events import ConfigurationError, DelayTooLongError, Events
from kombu_events.core import wire
from kombu_events.core.topology import build_topology
from kombu_events.publishing.publisher import addressed, build_message
from kombu_events.testing import StubEvents


@pytest.fixture
def billing(app):
    return Events(app, "billing", publish_delay_levels=4, publish_delay_unit_ms=500)


def test_a_delayed_event_is_addressed_to_the_exchanges_ladder_with_its_own_key_in_a_header(billing):
    message = build_message({"id": 7})
    assert addressed(billing.topology(), "invoice.remind", message, 1.2) == \
        ("events.deferred.1", "0.0.1.1.invoice.remind")  # 1.2 s: 3 units of 500 ms, rounded up
    assert message.properties["application_headers"][wire.ROUTING_KEY] == "invoice.remind"
    message = build_message({"id": 7})
    assert addressed(billing.topology(), "invoice.remind", message, 0) == ("events", "invoice.remind")
    assert message.properties["application_headers"] == {}


@pytest.mark.parametrize("delay", [-1, float("nan"), "5", True, None])
def test_a_delay_that_is_not_seconds_is_refused(billing, delay):
    with pytest.raises(ConfigurationError, match="delay must be a number of seconds"):
        billing.publish("invoice.remind", {}, delay=delay)


def test_a_delay_beyond_the_ladder_is_refused_at_publish_time_naming_its_reach(billing):
    with pytest.raises(DelayTooLongError, match=r"hold at most 7500 ms"):
        billing.publish("invoice.remind", {}, delay=7.501)


def test_every_service_bound_for_the_key_gets_it_when_due_never_earlier(app, billing):
    audit = Events(app, "audit", publish_delay_levels=4, publish_delay_unit_ms=500)
    seen = []

    @billing.handler("invoice.*", bind=True)
    def remind(event):
        seen.append(("billing", event.routing_key, event.payload))

    @audit.handler("invoice.#")
    def log(payload):
        seen.append(("audit", payload))

    with StubEvents(billing) as stub:
        billing.publish("invoice.remind", {"id": 7}, delay=1.2)
        billing.publish_many([("invoice.paid", {"id": 8})], delay=0.5)
        stub.join()
        assert seen == []
        stub.advance(0.5)
        assert seen == [("billing", "invoice.paid", {"id": 8}), ("audit", {"id": 8})]
        stub.advance(0.99)
        assert len(seen) == 2, "1.2 s is 3 units of 500 ms: due at 1.5 s"
        stub.advance(0.01)
    assert seen[2:] == [("billing", "invoice.remind", {"id": 7}), ("audit", {"id": 7})]
    assert [(p.routing_key, p.delay_ms) for p in stub.published] == [("invoice.remind", 1500), ("invoice.paid", 500)]


def test_a_delayed_event_nobody_is_bound_for_is_not_an_error_at_publish(app, billing):
    @billing.handler("invoice.*")
    def remind(payload):
        pass

    with StubEvents(billing) as stub:
        billing.publish("nobody.listens", {}, delay=1)
        stub.advance(2)
    assert stub.published[0].queues == () and stub.acked == []


def test_with_no_ladder_delayed_publishing_is_refused_and_no_entity_is_declared(app):
    plain = Events(app, "plain", publish_delay_levels=0)
    assert not any(q.name.startswith("events.") for q in build_topology(plain.settings, ()).queues)
    with pytest.raises(DelayTooLongError, match="publish_delay_levels"):
        plain.publish("a.b", {}, delay=1)


def test_a_binding_key_too_long_for_its_delayed_binding_is_refused_at_start(app):
    events = Events(app, "svc", publish_delay_levels=16)

    @events.handler("k" * 224)
    def h(payload):
        pass

    with pytest.raises(ConfigurationError, match="at most 223 bytes"):
        events.handlers  # resolving validates


@pytest.mark.parametrize("name", ["events.unrouted", "events.deferred", "events.deferred.3"])
def test_a_handler_queue_may_not_take_a_name_of_the_exchanges_ladder(app, name):
    events = Events(app, "svc")

    @events.handler("a.b", queue=name)
    def h(payload):
        pass

    with pytest.raises(ConfigurationError, match="collides"):
        events.handlers  # resolving validates
