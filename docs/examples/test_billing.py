import time

import pytest
from kombu_events.testing import running_worker

import billing
from billing import events, on_order_created


@pytest.fixture
def charged(monkeypatch):
    """The orders charged during the test: the payment provider is replaced."""
    orders: list[int] = []
    monkeypatch.setattr(billing, "charge", orders.append)
    return orders


# 1. A handler is a plain function: call it.

def test_an_order_is_charged(charged):
    on_order_created({"order_id": 42})
    assert charged == [42]


# 2. The stub: the worker's routing, decoding, retries and archive, in memory, on a virtual clock.

def test_a_created_order_is_charged(events_stub, charged):
    stub = events_stub(events)
    events.publish("orders.42.created", {"order_id": 42})
    stub.join()
    assert charged == [42]
    assert stub.calls(on_order_created) == [{"order_id": 42}]


def test_a_failed_charge_is_retried_a_second_later(events_stub, monkeypatch):
    attempts = []

    def charge(order_id):
        attempts.append(order_id)
        if len(attempts) == 1:
            raise ConnectionError("payment provider down")

    monkeypatch.setattr(billing, "charge", charge)
    stub = events_stub(events)
    events.publish("orders.42.created", {"order_id": 42})
    stub.join(fail_fast=False)  # the failure is what this test is about
    assert [r.delay_ms for r in stub.retried] == [1000]
    stub.advance(1)  # virtual seconds: nothing sleeps
    assert attempts == [42, 42]
    assert [a.attempt for a in stub.acked] == [2]


def test_an_order_without_an_id_is_archived(events_stub, charged):
    stub = events_stub(events)
    events.publish("orders.42.created", {"id": 42})
    stub.join()
    [archived] = stub.archived
    assert archived.reason.startswith("poisonous section failed: KeyError")
    assert charged == []


def test_an_archived_order_replayed_fails_again_under_a_new_key(events_stub, charged):
    stub = events_stub(events)
    events.publish("orders.42.created", {"id": 42})
    stub.join()
    [copy] = stub.archive()
    stub.replay(lambda c: c.key == copy.key)
    stub.join()
    [again] = stub.archive()
    assert again.key != copy.key and again.headers["kombu-events-replay-of"] == copy.key
    stub.purge(lambda c: c.key == again.key)
    assert stub.archive() == [] and charged == []


# 3. The real RabbitMQ: a vhost of the test's own, and a worker in a thread of this process.

def test_a_created_order_is_charged_through_rabbitmq(events_broker, charged):
    with running_worker(events, events_broker):
        events.publish("orders.42.created", {"order_id": 42})
        wait_until(lambda: charged == [42])


def wait_until(condition, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)
