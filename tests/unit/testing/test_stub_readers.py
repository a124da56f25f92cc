"""testing/stub_readers.py: the stub runs the readers of logs as a worker does: in order, one at a time, a failure
held in place until it passes or is archived."""
from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta, timezone

import pytest
import sqlalchemy as sa

from kombu_events import ConfigurationError, Event, Events, Exponential
from kombu_events.core.readers import OFFSET_HEADER
from kombu_events.database.tables import metadata
from kombu_events.testing import StubEvents
from kombu_events.testing.records import ArchivedCopy
from kombu_events.testing.stub_readers import start_offset

FAST = {"delay_unit_ms": 100, "delay_levels": 8, "backoff": Exponential(base_ms=200, max_delay_ms=1000)}


@pytest.fixture
def events(app, monkeypatch):
    monkeypatch.delenv("AMQP_EVENTS_MAX_RETRIES", raising=False)
    return Events(app, "billing", **FAST)


@pytest.fixture
def orders(events):
    return events.log("orders.#", keep=timedelta(days=1))


def ns(calls):
    return [payload["n"] for payload in calls]


def publish(stub, *numbers, key="orders.created"):
    for n in numbers:
        stub.publish(key, {"n": n})


def test_a_reader_gets_every_event_of_its_log_in_order(events, orders):
    @events.reader(orders)
    def project(payload):
        pass

    stub = StubEvents(events)
    publish(stub, 0, 1, 2)
    assert stub.calls(project) == [] and stub.position(project) is None  # nothing runs before join()
    stub.join()
    assert ns(stub.calls(project)) == [0, 1, 2]
    assert stub.position(project) == 3
    assert [(s.action, s.queue) for s in stub.settled] == [("ack", "billing.reader.project")] * 3
    publish(stub, 3)
    stub.join()
    assert ns(stub.calls(project)) == [0, 1, 2, 3] and stub.position(project) == 4


def test_a_failing_event_holds_the_later_ones_until_it_passes(events, orders):
    seen: list[int] = []

    @events.reader(orders)
    def project(payload):
        seen.append(payload["n"])
        if payload["n"] == 1 and seen.count(1) < 3:
            raise ConnectionError("database down")

    stub = StubEvents(events, rand=lambda: 0.0)
    publish(stub, 0, 1, 2)
    stub.join(fail_fast=False)
    assert seen == [0, 1] and stub.position(project) == 1
    [rerun] = [s for s in stub.settled if s.action == "rerun"]
    assert (rerun.attempt, rerun.delay_ms, rerun.queue) == (1, 200, "billing.reader.project")
    assert "ConnectionError: database down" in rerun.reason
    assert stub.retried == [] and stub.pending == []  # in place: no copy through the ladder
    stub.advance(0.199, fail_fast=False)
    assert seen == [0, 1]  # its backoff has not passed: event 2 waits behind it
    stub.advance(0.001, fail_fast=False)
    assert seen == [0, 1, 1]  # attempt 2 failed too: 400 ms more
    stub.advance(0.4)
    assert seen == [0, 1, 1, 1, 2] and stub.position(project) == 3
    assert [(s.action, s.attempt) for s in stub.settled if s.payload["n"] == 1] == [
        ("rerun", 1), ("rerun", 2), ("ack", 3)]
    assert stub.archive() == []


def test_after_max_retries_the_event_is_archived_and_the_reader_goes_on(events, orders):
    @events.reader(orders, max_retries=2)
    def project(payload):
        if payload["n"] == 1:
            raise ValueError("no such order")

    stub = StubEvents(events, rand=lambda: 0.0)
    publish(stub, 0, 1, 2)
    stub.advance(10, fail_fast=False)
    assert ns(stub.calls(project)) == [0, 1, 1, 1, 2]
    assert stub.position(project) == 3
    [copy] = stub.archive()
    assert (copy.queue, copy.payload, copy.headers[OFFSET_HEADER]) == ("billing.reader.project", {"n": 1}, 1)
    assert copy.reason == "gave up after 3 attempts (max_retries=2): builtins.ValueError: no such order"
    assert [s.action for s in stub.settled if s.payload["n"] == 1] == ["rerun", "rerun", "archive"]
    assert stub.replay() == [] and len(stub.archive()) == 1  # a reader's queue takes no events, as in a worker


def test_fail_fast_raises_once_the_failure_is_held_and_the_next_event_waits(events, orders):
    @events.reader(orders)
    def project(payload):
        if payload["n"] == 0:
            raise KeyError("bug")

    stub = StubEvents(events)
    publish(stub, 0, 1)
    with pytest.raises(KeyError, match="bug"):
        stub.join()
    assert [s.action for s in stub.settled] == ["rerun"]
    assert ns(stub.calls(project)) == [0] and stub.position(project) == 0


def test_start_next_and_last_skip_what_was_appended_before_the_reader_started(events, orders):
    @events.reader(orders, start="next")
    def from_next(payload):
        pass

    @events.reader(orders, start="last")
    def from_last(payload):
        pass

    @events.reader(orders)  # start="first"
    def from_first(payload):
        pass

    stub = StubEvents(events)
    publish(stub, 0, 1)
    stub.join()  # the readers start here, as a worker that starts now: the log holds 0 and 1
    publish(stub, 2)
    stub.join()
    assert ns(stub.calls(from_next)) == [2]
    assert ns(stub.calls(from_last)) == [1, 2]
    assert ns(stub.calls(from_first)) == [0, 1, 2]
    assert stub.position(from_next) == stub.position(from_last) == stub.position(from_first) == 3


def test_two_readers_of_one_log_each_get_every_event(events, orders):
    @events.reader(orders)
    def one(payload):
        if payload["n"] == 0 and len(stub.calls(one)) == 1:
            raise ConnectionError("down")

    @events.reader(orders)
    def two(payload):
        pass

    stub = StubEvents(events)
    publish(stub, 0, 1)
    stub.advance(1, fail_fast=False)
    assert ns(stub.calls(one)) == [0, 0, 1]  # one's failure held one, not two
    assert ns(stub.calls(two)) == [0, 1]


def test_a_reader_of_a_log_the_event_is_not_bound_for_gets_nothing(events, orders):
    @events.reader(orders)
    def project(payload):
        pass

    @events.handler("refunds.#", "order.*")
    def refund(payload):
        pass

    stub = StubEvents(events)
    publish(stub, 0, key="refunds.created")
    publish(stub, 1, key="order.created")  # orders.# does not match order.created
    stub.join()
    assert stub.calls(project) == [] and stub.position(project) == 0
    assert stub.log("orders") == [] and ns(stub.calls(refund)) == [0, 1]


def test_calls_and_position_name_readers_only(events, orders):
    @events.reader(orders, bind=True)
    def project(event):
        pass

    @events.handler("orders.#")
    def charge(payload):
        pass

    stub = StubEvents(events)
    publish(stub, 0, 1)
    stub.join()
    assert [(e.payload["n"], e.headers[OFFSET_HEADER]) for e in stub.calls(project)] == [(0, 0), (1, 1)]
    assert all(isinstance(e, Event) and e.queue == "billing.reader.project" for e in stub.calls(project))
    assert ns(stub.calls(charge)) == [0, 1]
    with pytest.raises(ConfigurationError, match="is not a reader"):
        stub.position(charge)
    with pytest.raises(ConfigurationError, match="is not a handler or reader"):
        stub.calls(ns)


@dataclass
class Order:
    n: int


def test_a_typed_reader_gets_its_model_and_an_event_that_does_not_fit_is_archived(events, orders):
    @events.reader(orders)
    def project(order: Order):
        pass

    stub = StubEvents(events)
    stub.publish("orders.created", {"n": 1})
    stub.publish("orders.created", {"sku": "x"})
    stub.publish("orders.created", {"n": 2})
    stub.join()
    assert stub.calls(project) == [Order(1), Order(2)]
    [copy] = stub.archive()
    assert copy.payload == {"sku": "x"} and stub.position(project) == 3


def test_a_once_reader_writes_one_inbox_row_per_offset(app, tmp_path):
    engine = sa.create_engine(f"sqlite:///{tmp_path / 'db.sqlite3'}")
    metadata.create_all(engine)
    events = Events(app, "billing", database=engine, **FAST)
    orders = events.log("orders.#", keep=timedelta(days=1))

    @events.reader(orders, once=True)
    def project(payload):
        pass

    stub = StubEvents(events)
    publish(stub, 0, 1)
    stub.join()
    with engine.connect() as connection:
        rows = connection.execute(sa.select(metadata.tables["kombu_events_inbox"].c["queue", "dedup_key"]))
        assert sorted(rows) == [("billing.reader.project", "0@0"), ("billing.reader.project", "1@0")]
    assert ns(stub.calls(project)) == [0, 1]
    engine.dispose()


def _records(*ats: float) -> list[ArchivedCopy]:
    return [ArchivedCopy(f"@{i}", i, "orders.created", b"{}", {}, at) for i, at in enumerate(ats)]


@pytest.mark.parametrize(("start", "ats", "offset"), [
    ("first", (0, 1), 0),
    ("next", (0, 1), 2),
    ("last", (0, 1), 1),
    ("last", (), 0),
    (1, (0, 1, 2), 1),
    (7, (0, 1), 2),  # past the end: the next, as RabbitMQ clamps it
    (datetime.fromtimestamp(1000.5, timezone.utc), (0, 0.5, 1), 1),  # the first appended at or after it
    (datetime.fromtimestamp(1002, timezone.utc), (0, 1), 2),
])
def test_start_offset(start, ats, offset):
    assert start_offset(start, _records(*ats), epoch=1000.0) == offset
