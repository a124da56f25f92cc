"""testing/stub_batches.py: a batch handler gets lists in the stub too, and each event is settled on its own."""
from __future__ import annotations

import pytest

from kombu_events import Archive, BatchFailed, BatchOf, Events, Exponential, Retry
from kombu_events.testing import StubEvents

FAST = {"delay_unit_ms": 100, "delay_levels": 8, "backoff": Exponential(base_ms=200, max_delay_ms=1000)}


@pytest.fixture
def events(app, monkeypatch):
    monkeypatch.delenv("AMQP_EVENTS_MAX_RETRIES", raising=False)
    return Events(app, "billing", **FAST)


def test_events_due_together_make_one_call_of_at_most_max(events):
    @events.handler("orders.#", batch=BatchOf(max=4, wait_ms=10))
    def store(payloads):
        pass

    stub = StubEvents(events)
    for n in range(10):
        stub.publish("orders.created", {"n": n})
    stub.join()
    assert [[p["n"] for p in call] for call in stub.calls(store)] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert [s.action for s in stub.settled] == ["ack"] * 10


def test_batch_failed_retries_only_the_events_it_names(events):
    seen: list[int] = []

    @events.handler("orders.#", batch=BatchOf(max=10))
    def store(payloads):
        seen.extend(p["n"] for p in payloads)
        failures = {i: ValueError("bad sku") for i, p in enumerate(payloads)
                    if p["n"] % 3 == 0 and seen.count(p["n"]) == 1}
        if failures:
            raise BatchFailed(failures)

    stub = StubEvents(events)
    for n in range(6):
        stub.publish("orders.created", {"n": n})
    stub.join(fail_fast=False)  # ValueError is declared nowhere: join() would re-raise it
    assert sorted((s.action, s.attempt) for s in stub.settled) == [("ack", 1)] * 4 + [("retry", 1)] * 2
    stub.advance(5, fail_fast=False)
    assert stub.calls(store)[-1] == [{"n": 0}, {"n": 3}]
    assert [s.action for s in stub.settled[6:]] == ["ack", "ack"]
    assert stub.pending == []


def test_retry_and_archive_per_event_and_a_plain_exception_fails_all(events):
    @events.handler("orders.#", batch=BatchOf(max=10), max_retries=1)
    def store(payloads):
        if len(payloads) == 3:
            raise BatchFailed({0: Archive("no such customer"), 1: Retry(2)})
        raise RuntimeError("database down")

    stub = StubEvents(events)
    for n in range(3):
        stub.publish("orders.created", {"n": n})
    stub.join(fail_fast=False)
    assert [s.action for s in stub.settled] == ["archive", "retry", "ack"]
    assert stub.settled[1].delay_ms == 2000
    stub.advance(3, fail_fast=False)  # alone now: RuntimeError fails it, its retries spent (max_retries=1)
    assert [(s.action, s.attempt) for s in stub.settled[3:]] == [("archive", 2)]
    assert "database down" in stub.settled[3].reason


def test_bind_and_undecodable_events(events):
    @events.handler("orders.#", batch=BatchOf(max=10), bind=True)
    def store(batch):
        assert all(event.routing_key == "orders.created" for event in batch)

    stub = StubEvents(events)
    stub.publish("orders.created", {"n": 1})
    stub.publish("orders.created", b"{not json", content_type="application/json")
    stub.publish("orders.created", {"n": 2})
    stub.join()
    assert [[e.payload for e in call] for call in stub.calls(store)] == [[{"n": 1}, {"n": 2}]]
    assert [s.action for s in stub.settled] == ["ack", "archive", "ack"]
