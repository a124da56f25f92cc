"""The outbox on SQLite: publish inside a transaction writes a row that commits or rolls back with it; the relay
publishes committed rows in id order with confirms and deletes only the confirmed ones."""
from __future__ import annotations

import gc
import json

import pytest
import sqlalchemy as sa
from celery import Celery
from sqlalchemy.orm import Session

from kombu_events import Events
from kombu_events.database import Relay, status
from kombu_events.database.tables import metadata
from kombu_events.errors import BrokerUnavailableError, UnroutableError


class FakePublisher:
    """Confirms every message, except routing keys listed in ``refuse``; ``down``: the broker is away."""

    def __init__(self):
        self.sent, self.refuse, self.down = [], set(), False

    def send(self, exchange, routing_key, message):
        assert self.send_many([(exchange, routing_key, message)]) == [None]

    def send_many(self, items):
        if self.down:
            raise BrokerUnavailableError("away")
        self.sent += [(key, message.properties["message_id"], json.loads(message.body)) for _x, key, message in items]
        return [UnroutableError("no queue", exchange=x, routing_key=key) if key in self.refuse else None
                for x, key, _m in items]


@pytest.fixture
def service(tmp_path):
    engine = sa.create_engine(f"sqlite:///{tmp_path / 'db.sqlite3'}")
    metadata.create_all(engine)
    app = Celery("t", broker="memory://", set_as_current=False)
    events = Events(app, service="outbox-svc", database=engine, outbox=True)
    events.publishing.publisher = FakePublisher()
    yield events, engine
    engine.dispose()


def test_only_committed_events_are_relayed_in_id_order_and_deleted_once_confirmed(service):
    events, engine = service
    with Session(engine) as s, s.begin():
        first = events.publish("orders.1", {"n": 1}, using=s)
        events.publish("orders.2", {"n": 2}, using=s)
    with pytest.raises(RuntimeError), Session(engine) as s, s.begin():
        events.publish("orders.3", {"n": 3}, using=s)
        raise RuntimeError("rolled back")
    assert first.stored_locally and status(events.database).depth == 2
    relay = Relay(events.database, events.publishing)
    assert relay.run_once() == 2
    sent = events.publishing.publisher.sent
    assert [(key, body) for key, _id, body in sent] == [("orders.1", {"n": 1}), ("orders.2", {"n": 2})]
    assert sent[0][1] == first, "the message id given at publish time is the one published"
    assert status(events.database) == (0, None, 0)


def test_a_refused_row_stays_marked_and_a_broker_outage_keeps_every_row(service):
    events, engine = service
    publisher = events.publishing.publisher
    with Session(engine) as s, s.begin():
        events.publish_many([("orders.ok", {}), ("orders.nobody", {})], using=s)
    publisher.down = True
    relay = Relay(events.database, events.publishing, retry_after_s=3600)
    with pytest.raises(BrokerUnavailableError):
        relay.run_once()
    assert status(events.database).depth == 2
    publisher.down, publisher.refuse = False, {"orders.nobody"}
    assert relay.run_once() == 2
    found = status(events.database)
    assert (found.depth, found.failing) == (1, 1)
    assert relay.run_once() == 0, "a refused row waits retry_after_s before its next attempt"


def test_outside_a_transaction_publish_goes_straight_to_the_broker(service):
    events, _engine = service
    events.publish("orders.direct", {"n": 0})
    assert [key for key, _i, _b in events.publishing.publisher.sent] == ["orders.direct"]
    assert status(events.database).depth == 0


def test_the_metrics_show_the_outbox_the_relay_read():
    from prometheus_client import CollectorRegistry

    from kombu_events.integrations.metrics import PrometheusMetrics

    registry = CollectorRegistry()
    metrics = PrometheusMetrics(registry)
    assert registry.get_sample_value("kombu_events_outbox_depth", {"service": "billing"}) is None
    metrics.outbox_read("billing", 3, 12.5)
    assert registry.get_sample_value("kombu_events_outbox_depth", {"service": "billing"}) == 3
    assert registry.get_sample_value("kombu_events_outbox_oldest_age_seconds", {"service": "billing"}) == 12.5
    metrics.outbox_read("billing", 0, None)
    assert registry.get_sample_value("kombu_events_outbox_oldest_age_seconds", {"service": "billing"}) == 0
    del metrics, registry  # its weak circuit_changed receiver goes with them (test_signals.py counts receivers)
    gc.collect()


def test_a_transaction_of_another_database_is_refused(service, tmp_path):
    from kombu_events.errors import ConfigurationError

    events, _engine = service
    other = sa.create_engine(f"sqlite:///{tmp_path / 'other.sqlite3'}")
    with pytest.raises(ConfigurationError, match="not of the service's database"), Session(other) as s, s.begin():
        events.publish("orders.1", {}, using=s)
    other.dispose()
