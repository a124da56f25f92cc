"""core/wire.py: attempt counting, the original routing key, and the headers of retries, archive, replay."""
from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest

from kombu_events.core import wire
from kombu_events.errors import HeaderError

QUEUE = "billing.audit"


def death(queue: str = QUEUE, reason: str = "rejected", count: int | None = 1, keys=("orders.1.created",)):
    entry = {"queue": queue, "reason": reason, "exchange": "events", "routing-keys": list(keys)}
    if count is not None:
        entry["count"] = count
    return entry


@pytest.mark.parametrize(
    "headers, expected",
    [
        (None, 1),
        ({}, 1),
        ({"x-request-id": "r1"}, 1),
        ({wire.ATTEMPTS: 3}, 4),
        ({wire.ATTEMPTS: None}, 1),
        ({wire.ATTEMPTS: 0}, 1),
        ({"x-death": [death(count=2)]}, 3),
        ({"x-death": [death(count=None)]}, 2),
        ({wire.ATTEMPTS: 3, "x-death": [death(count=2)]}, 6),
        ({"x-death": [death(queue="billing.other", count=4)]}, 1),
        ({"x-death": [death(reason="expired", count=4)]}, 1),
        ({"x-death": [death(queue="billing.delay.0", reason="expired")]}, 1),
        ({"x-death": [death(queue="billing.other", count="not ours to read")]}, 1),
        ({wire.ATTEMPTS: 1, "x-death": [
            death(count=2), death(queue="billing.delay.0", reason="expired", count=2),
            death(queue="billing.other", count=7)]}, 4),
    ],
)
def test_attempt_of(headers, expected):
    assert wire.attempt_of(headers, QUEUE) == expected


@pytest.mark.parametrize(
    "headers, named",
    [
        ({wire.ATTEMPTS: "3"}, wire.ATTEMPTS),
        ({wire.ATTEMPTS: "three"}, wire.ATTEMPTS),
        ({wire.ATTEMPTS: -5}, wire.ATTEMPTS),
        ({wire.ATTEMPTS: 2.0}, wire.ATTEMPTS),
        ({wire.ATTEMPTS: True}, wire.ATTEMPTS),
        ({wire.ATTEMPTS: float("nan")}, wire.ATTEMPTS),
        ({wire.ATTEMPTS: b"\xff"}, wire.ATTEMPTS),
        ({wire.ATTEMPTS: {"n": 1}}, wire.ATTEMPTS),
        ({"x-death": [death(count="abc")]}, "x-death"),
        ({"x-death": [death(count={"n": 1})]}, "x-death"),
        ({"x-death": [death(count=-1)]}, "x-death"),
        ({"x-death": [death(count=1.5)]}, "x-death"),
        ({"x-death": "rejected once"}, "x-death"),
        ({"x-death": {"queue": QUEUE}}, "x-death"),
        ({"x-death": ["not a table", death()]}, "x-death"),
    ],
)
def test_attempt_of_names_the_header_it_cannot_read(headers, named):
    with pytest.raises(HeaderError) as caught:
        wire.attempt_of(headers, QUEUE)
    assert caught.value.header == named
    assert repr(named) in str(caught.value)


@pytest.mark.parametrize(
    "headers, expected",
    [
        (None, "delivered.key"),
        ({}, "delivered.key"),
        ({wire.ROUTING_KEY: "orders.7.created", "x-death": [death(keys=("other",))]}, "orders.7.created"),
        ({"x-death": [death(keys=("orders.9.created",))]}, "orders.9.created"),
        ({"x-death": [death(queue="billing.delay.0", reason="expired", keys=("0.0.1.billing.audit",)),
                      death(keys=("orders.9.created",))]}, "orders.9.created"),
        ({"x-death": [death(queue="billing.other", keys=("orders.9.created",))]}, "delivered.key"),
        ({"x-death": [death(keys=())]}, "delivered.key"),
        ({"x-request-id": "r"}, "delivered.key"),
    ],
)
def test_original_routing_key(headers, expected):
    assert wire.original_routing_key(headers, "delivered.key", QUEUE) == expected


@pytest.mark.parametrize(
    "headers, named",
    [
        ({wire.ROUTING_KEY: b"orders.1"}, wire.ROUTING_KEY),
        ({wire.ROUTING_KEY: 7}, wire.ROUTING_KEY),
        ({"x-death": [death(keys=[b"orders.1"])]}, "x-death"),
        ({"x-death": [{"queue": QUEUE, "reason": "rejected", "routing-keys": "orders.1"}]}, "x-death"),
        ({"x-death": 3}, "x-death"),
    ],
)
def test_original_routing_key_names_the_header_it_cannot_read(headers, named):
    with pytest.raises(HeaderError) as caught:
        wire.original_routing_key(headers, "delivered.key", QUEUE)
    assert caught.value.header == named


def _iso(value: str) -> datetime:
    parsed = datetime.fromisoformat(value)
    assert parsed.tzinfo is not None
    assert abs(datetime.now(timezone.utc) - parsed) < timedelta(minutes=1)
    return parsed


USER_HEADERS = {"x-request-id": "req-1", "x-tenant": "acme", "trace": "t-9", "count": 3}
BROKER_HEADERS = {
    "x-death": [death()], "x-first-death-queue": QUEUE, "x-first-death-reason": "rejected",
    "x-first-death-exchange": "events", "x-last-death-queue": QUEUE, "x-last-death-reason": "rejected",
    "x-last-death-exchange": "events",
}


def test_retry_headers_keep_user_headers_and_drop_broker_dead_letter_headers():
    original = {**USER_HEADERS, **BROKER_HEADERS}
    snapshot = dict(original)
    new = wire.retry_headers(original, attempt=2, routing_key="orders.1.created", error="ValueError: boom")
    assert original == snapshot, "the delivered headers are not mutated"
    assert {k: new[k] for k in USER_HEADERS} == USER_HEADERS
    assert not set(BROKER_HEADERS) & set(new)
    assert new[wire.ATTEMPTS] == 2
    assert new[wire.ROUTING_KEY] == "orders.1.created"
    assert new[wire.LAST_ERROR] == "ValueError: boom"
    _iso(new[wire.FIRST_FAILURE_AT])
    assert wire.attempt_of(new, QUEUE) == 3, "the x-death rejects are not counted twice"


def test_retry_headers_keep_the_first_failure_time_and_bound_the_error():
    new = wire.retry_headers({wire.FIRST_FAILURE_AT: "2020-01-01T00:00:00.000+00:00"},
                             attempt=3, routing_key="k", error="e" * 10_000)
    assert new[wire.FIRST_FAILURE_AT] == "2020-01-01T00:00:00.000+00:00"
    assert new[wire.LAST_ERROR] == "e" * 500


def test_retry_headers_of_a_message_without_headers():
    new = wire.retry_headers(None, attempt=1, routing_key="k", error="e")
    assert set(new) == {wire.ATTEMPTS, wire.ROUTING_KEY, wire.FIRST_FAILURE_AT, wire.LAST_ERROR}


def _archived(headers=None):
    return wire.archive_headers(
        {**USER_HEADERS, **BROKER_HEADERS} if headers is None else headers,
        attempt=6, queue=QUEUE, routing_key="orders.1.created", reason="r" * 600,
        exception="builtins.ValueError: " + "x" * 600, traceback="Traceback ...\n" * 200,
    )


def test_archive_headers():
    new = _archived()
    assert {k: new[k] for k in USER_HEADERS} == USER_HEADERS
    assert not set(BROKER_HEADERS) & set(new)
    assert new[wire.ATTEMPTS] == 6
    assert new[wire.QUEUE] == QUEUE
    assert new[wire.ROUTING_KEY] == "orders.1.created"
    assert new[wire.REASON] == "r" * 500
    assert new[wire.EXCEPTION].startswith("builtins.ValueError: ") and len(new[wire.EXCEPTION]) == 500
    assert new[wire.TRACEBACK] == "Traceback ...\n" * 200, "the traceback is bounded by traceback_limit, not here"
    archived_at = _iso(new[wire.ARCHIVED_AT])
    assert new[wire.FIRST_FAILURE_AT] == new[wire.ARCHIVED_AT]
    assert archived_at


def test_archive_headers_keep_the_first_failure_of_earlier_retries():
    retried = wire.retry_headers({}, attempt=1, routing_key="k", error="e")
    assert _archived(retried)[wire.FIRST_FAILURE_AT] == retried[wire.FIRST_FAILURE_AT]


def test_replay_headers_reset_the_counter_and_drop_failure_details():
    replayed = wire.replay_headers({**_archived(), "x-death": [death(count=9)]})
    assert replayed == {**USER_HEADERS, wire.ROUTING_KEY: "orders.1.created"}
    assert wire.attempt_of(replayed, QUEUE) == 1
    assert wire.original_routing_key(replayed, "0.0.1.billing.audit", QUEUE) == "orders.1.created"


def test_replay_headers_of_nothing():
    assert wire.replay_headers(None) == {}


def test_requeue_headers_count_a_redelivery_and_keep_the_attempts():
    original = {"x-request-id": "r-1", wire.ATTEMPTS: 2, "x-death": [{"queue": "q", "reason": "rejected", "count": 1}]}
    attempt = wire.attempt_of(original, "q")  # 2 failed + 1 rejected + this one
    new = wire.requeue_headers(original, attempt=attempt, redeliveries=1, routing_key="orders.1")
    assert new[wire.ATTEMPTS] == 3  # nothing spent by the redelivery; the reject is folded in
    assert new[wire.REDELIVERIES] == 1
    assert new[wire.ROUTING_KEY] == "orders.1"
    assert new["x-request-id"] == "r-1" and "x-death" not in new
    assert wire.attempt_of(new, "q") == attempt
    assert wire.redeliveries_of(new) == 1


@pytest.mark.parametrize("value, expected", [(None, 0), (0, 0), (3, 3), (2**31 - 1, 2**31 - 1)])
def test_redeliveries_of(value, expected):
    assert wire.redeliveries_of({} if value is None else {wire.REDELIVERIES: value}) == expected


@pytest.mark.parametrize("value", [-2, "x", "3", float("inf"), 1.0, False, [1], b"1", 2**31, 2**70])
def test_redeliveries_of_names_a_header_it_cannot_read(value):
    with pytest.raises(HeaderError, match=wire.REDELIVERIES):
        wire.redeliveries_of({wire.REDELIVERIES: value})


# -- x-delivery-count: a quorum queue's own count of the deliveries before this one --------------

@pytest.mark.parametrize("ours, count, expected", [
    (0, 1, 0),   # the first redelivery: the caller counts it
    (0, 4, 3),   # three redeliveries went before this one (a worker killed three times before it read it)
    (2, 3, 4),   # earlier copies' redeliveries add up
    (0, 2**40, 2**31 - 1),  # bounded as our own counter is
])
def test_a_quorum_queues_delivery_count_adds_the_redeliveries_before_this_one(ours, count, expected):
    headers = {wire.REDELIVERIES: ours, wire.DELIVERY_COUNT: count}
    assert wire.redeliveries_of(headers, redelivered=True) == expected


@pytest.mark.parametrize("count", [None, 0, -3, True, "7", 7.0, [7]])
def test_a_delivery_count_the_broker_cannot_have_set_counts_nothing_more(count):
    assert wire.redeliveries_of({wire.REDELIVERIES: 1, wire.DELIVERY_COUNT: count}, redelivered=True) == 1


def test_a_delivery_count_on_a_first_delivery_counts_nothing():
    # RabbitMQ's quorum queues send x-delivery-count 0 on a first delivery; a publisher may set any.
    assert wire.redeliveries_of({wire.DELIVERY_COUNT: 9}, redelivered=False) == 0


@pytest.mark.parametrize("make", [
    lambda h: wire.retry_headers(h, attempt=1, routing_key="k", error="e"),
    lambda h: wire.requeue_headers(h, attempt=1, redeliveries=1, routing_key="k"),
    lambda h: wire.archive_headers(h, attempt=1, queue="q", routing_key="k", reason="r", exception="E",
                                   traceback=""),
    wire.replay_headers,
])
def test_a_republished_copy_never_carries_the_brokers_delivery_count(make):
    # The copy is a new message: its queue counts its deliveries afresh.
    new = make({wire.DELIVERY_COUNT: 5, "x-request-id": "r-1"})
    assert wire.DELIVERY_COUNT not in new and new["x-request-id"] == "r-1"
