"""core/settlement.py: the first step that settles a delivery for every outcome, and every step after a refusal."""
from __future__ import annotations

import copy
import re

import pytest
from hypothesis import example, given, settings, strategies as st

from kombu_events.core import names, wire
from kombu_events.core.backoff import Exponential
from kombu_events.core.codec import JSON
from kombu_events.core.config import resolve_settings
from kombu_events.core.decision import (
    ARCHIVE,
    DEFERRED,
    FAILED,
    LOST,
    OK,
    REDELIVERED,
    RETRY,
    UNDECODABLE,
    Outcome,
)
from kombu_events.core.delivery import Delivery, read_delivery
from kombu_events.core.handlers import Handler
from kombu_events.core.settlement import ACK, Ack, Hold, Republish, Rerun, Step, plan
from kombu_events.core.topology import Topology, build_topology
from kombu_events.testing.broker_model import BrokerModel

QUEUE = "billing.audit"
EVENT_KEY = "orders.7.created"
LADDER_KEY = "0.0.0.0.0.0.1.0.billing.audit"  # the key it came back from the ladder with
FIRST_FAILURE = "2024-05-01T12:00:00.000+00:00"
USERID = "billing-svc"
MAX_RETRIES = 3
BACKOFF = Exponential(base_ms=100, factor=2, max_delay_ms=25_500)  # retry n waits 100 * 2**(n-1) ms
SETTINGS = resolve_settings("billing", environ={}, delay_unit_ms=100, delay_levels=8)  # ladder: 0 .. 25_500 ms
TOPOLOGY = build_topology(SETTINGS, [
    Handler(fn=lambda payload: None, name="audit", queue=QUEUE, binding_keys=("orders.#",),
            max_retries=MAX_RETRIES, backoff=BACKOFF),
])
USER_HEADERS = {"x-request-id": "r-1", "tenant": "acme", "nested": {"items": [1, 2.5, None, b"\x00"]}}
BROKER_HEADERS = ("x-death", "x-first-death-queue", "x-first-death-reason", "x-last-death-queue")
LIBRARY_HEADERS = {wire.ATTEMPTS, wire.QUEUE, wire.ROUTING_KEY, wire.REASON, wire.EXCEPTION, wire.TRACEBACK,
                   wire.ARCHIVED_AT, wire.FIRST_FAILURE_AT, wire.DROPPED_HEADERS, wire.EXPIRATION, wire.ARCHIVE_KEY}
NACKED = "nacked by the broker"
BOOM = Outcome(FAILED, "builtins.ValueError: boom", "builtins.ValueError: boom")


def _delivery(*, attempts: int = 1, redeliveries: int = 0, user_id: str = USERID, **headers) -> Delivery:
    """A delivery back from the ladder: ``attempts`` failed before, its first failure at FIRST_FAILURE."""
    table = {
        **USER_HEADERS,
        wire.ATTEMPTS: attempts,
        wire.REDELIVERIES: redeliveries,
        wire.ROUTING_KEY: EVENT_KEY,
        wire.FIRST_FAILURE_AT: FIRST_FAILURE,
        "x-death": [{"queue": "billing.delay.1", "reason": "expired", "count": 1, "exchange": "billing.delay.1",
                     "routing-keys": [LADDER_KEY]}],
        "x-first-death-queue": "billing.delay.1",
        "x-first-death-reason": "expired",
        "x-last-death-queue": "billing.delay.1",
        **headers,
    }
    properties = {
        "content_type": JSON, "content_encoding": "utf-8", "delivery_mode": 2, "priority": 3,
        "message_id": "m-1", "correlation_id": wire.Undecoded.of(b"c-\xff"),  # not UTF-8
        "timestamp": 1_700_000_000, "type": "order.created", "user_id": user_id, "app_id": "shop",
        "expiration": "60000", "application_headers": table,
    }
    delivery = read_delivery(QUEUE, b'{"order_id": 7}', properties, {"routing_key": LADDER_KEY})
    assert not delivery.unreadable
    return delivery


def _plan(delivery: Delivery, outcome: Outcome, **kwargs) -> Step:
    options = {"max_retries": MAX_RETRIES, "backoff": BACKOFF, "topology": TOPOLOGY, "userid": USERID,
               "rand": lambda: 0.0}
    options.update(kwargs)
    return plan(delivery, outcome, **options)


def _summary(step: Step) -> tuple:
    if isinstance(step, Republish):
        return type(step), step.action, step.exchange, step.routing_key, step.delay_ms
    return type(step), step.action


def _headers(step: Step) -> dict:
    assert isinstance(step, Republish)
    return step.properties["application_headers"]


# (attempts failed before, redeliveries before, outcome) -> first step, and what its reason starts with
CASES = {
    "ok": (1, 0, Outcome(OK), (Ack, "ack"), ""),
    "failed, attempts left": (
        1, 0, BOOM, (Republish, "retry", "billing.delay.1", "0.0.0.0.0.0.1.0.billing.audit", 200),
        "builtins.ValueError: boom"),
    "failed on the first attempt": (
        0, 0, BOOM, (Republish, "retry", "billing.delay.0", "0.0.0.0.0.0.0.1.billing.audit", 100),
        "builtins.ValueError: boom"),
    "failed on the last attempt": (
        3, 0, BOOM, (Republish, "archive", "billing.archive", EVENT_KEY, 0),
        "gave up after 4 attempts (max_retries=3): builtins.ValueError: boom"),
    "retry with a delay": (
        1, 0, Outcome(RETRY, "rate limited", "kombu_events.errors.Retry: rate limited", delay_ms=250),
        (Republish, "retry", "billing.delay.1", "0.0.0.0.0.0.1.1.billing.audit", 300), "rate limited"),
    "retry without a delay": (
        2, 0, Outcome(RETRY, "retry", "kombu_events.errors.Retry: retry"),
        (Republish, "retry", "billing.delay.2", "0.0.0.0.0.1.0.0.billing.audit", 400), "retry"),
    "retry with a subnormal delay": (  # 5e-324 / 100 rounds to 0.0: still one whole unit, never none
        1, 0, Outcome(RETRY, "soon", delay_ms=5e-324),
        (Republish, "retry", "billing.delay.0", "0.0.0.0.0.0.0.1.billing.audit", 100), "soon"),
    "retry at the ladder's reach": (
        1, 0, Outcome(RETRY, "later", delay_ms=25_500),
        (Republish, "retry", "billing.delay.7", "1.1.1.1.1.1.1.1.billing.audit", 25_500), "later"),
    "retry beyond the ladder": (
        1, 0, Outcome(RETRY, "later", delay_ms=25_501), (Republish, "archive", "billing.archive", EVENT_KEY, 0),
        "retry delay 25501 ms exceeds the ladder's 25500 ms"),
    "retry on the last attempt": (
        3, 0, Outcome(RETRY, "later", delay_ms=250), (Republish, "archive", "billing.archive", EVENT_KEY, 0),
        "gave up after 4 attempts (max_retries=3): later"),
    "archive": (
        0, 0, Outcome(ARCHIVE, "order cancelled", "kombu_events.errors.Archive: order cancelled", "Traceback"),
        (Republish, "archive", "billing.archive", EVENT_KEY, 0), "order cancelled"),
    "undecodable": (
        0, 0, Outcome(UNDECODABLE, "body is not valid JSON", "DecodeError: body is not valid JSON"),
        (Republish, "archive", "billing.archive", EVENT_KEY, 0), "body is not valid JSON"),
    "lost": (
        1, 0, Outcome(LOST, "pool process lost: WorkerLostError"),
        (Republish, "retry", "billing.delay.0", "0.0.0.0.0.0.0.1.billing.audit", 100), "pool process lost"),
    "lost on the last attempt": (
        3, 0, Outcome(LOST, "pool process lost: WorkerLostError"),
        (Republish, "archive", "billing.archive", EVENT_KEY, 0), "gave up after 4 attempts"),
    "redelivered under the cap": (
        1, 3, Outcome(REDELIVERED, "redelivered"),
        (Republish, "requeue", "billing.delivery", "0.0.0.0.0.0.0.0.billing.audit", 0), "redelivered after"),
    "redelivered over the cap": (
        1, 4, Outcome(REDELIVERED, "redelivered"), (Republish, "archive", "billing.archive", EVENT_KEY, 0),
        "redelivered 5 times without an ack (max_retries=3)"),
    "deferred": (
        1, 0, Outcome(DEFERRED, "circuit open", delay_ms=5000),
        (Republish, "requeue", "billing.delay.5", "0.0.1.1.0.0.1.0.billing.audit", 5000), "circuit open"),
    "deferred without a delay": (
        1, 0, Outcome(DEFERRED), (Republish, "requeue", "billing.delay.0", "0.0.0.0.0.0.0.1.billing.audit", 100),
        "deferred"),
    "deferred on the last attempt": (
        3, 0, Outcome(DEFERRED, "circuit open", delay_ms=100),
        (Republish, "requeue", "billing.delay.0", "0.0.0.0.0.0.0.1.billing.audit", 100), "circuit open"),
    "deferred beyond the ladder": (
        1, 0, Outcome(DEFERRED, "circuit open", delay_ms=30_000),
        (Republish, "archive", "billing.archive", EVENT_KEY, 0), "requeue delay 30000 ms exceeds the ladder's"),
}
REPUBLISHED = {name: case for name, case in CASES.items() if case[3][0] is Republish}


@pytest.mark.parametrize("attempts, redeliveries, outcome, expected, reason", CASES.values(), ids=CASES.keys())
def test_first_step(attempts, redeliveries, outcome, expected, reason):
    step = _plan(_delivery(attempts=attempts, redeliveries=redeliveries), outcome)
    assert _summary(step) == expected
    assert step.reason.startswith(reason)


def test_ok_is_the_shared_ack():
    assert _plan(_delivery(), Outcome(OK)) is ACK


@pytest.mark.parametrize("attempts, redeliveries, outcome, expected, reason", REPUBLISHED.values(),
                         ids=REPUBLISHED.keys())
def test_a_copy_keeps_the_publishers_headers_and_drops_the_brokers(attempts, redeliveries, outcome, expected,
                                                                   reason):
    headers = _headers(_plan(_delivery(attempts=attempts, redeliveries=redeliveries), outcome))
    assert {k: headers[k] for k in USER_HEADERS} == USER_HEADERS
    assert not set(BROKER_HEADERS) & set(headers)
    assert headers[wire.ROUTING_KEY] == EVENT_KEY
    assert headers[wire.FIRST_FAILURE_AT] == FIRST_FAILURE
    assert headers[wire.EXPIRATION] == "60000"


@pytest.mark.parametrize("attempts, redeliveries, outcome, expected, reason", REPUBLISHED.values(),
                         ids=REPUBLISHED.keys())
def test_a_copy_keeps_the_publishers_properties(attempts, redeliveries, outcome, expected, reason):
    properties = _plan(_delivery(attempts=attempts, redeliveries=redeliveries), outcome).properties
    assert properties == {
        "content_type": JSON, "content_encoding": "utf-8", "delivery_mode": 2, "priority": 3, "message_id": "m-1",
        "correlation_id": b"c-\xff", "timestamp": 1_700_000_000, "type": "order.created", "user_id": USERID,
        "app_id": "shop", "application_headers": properties["application_headers"],
    }


def test_a_retry_counts_the_failed_attempt_and_records_the_error():
    headers = _headers(_plan(_delivery(attempts=1, redeliveries=2), BOOM))
    assert headers[wire.ATTEMPTS] == 2
    assert headers[wire.REDELIVERIES] == 2
    assert headers[wire.LAST_ERROR] == "builtins.ValueError: boom"
    assert wire.REASON not in headers


def test_a_retry_folds_rejects_the_broker_dead_lettered_into_the_counter():
    deaths = [{"queue": QUEUE, "reason": "rejected", "count": 2, "routing-keys": [EVENT_KEY]}]
    delivery = _delivery(attempts=1, **{"x-death": deaths})
    assert delivery.attempt == 4
    headers = _headers(_plan(delivery, BOOM, max_retries=5))
    assert headers[wire.ATTEMPTS] == 4
    assert "x-death" not in headers


def test_a_first_failure_is_stamped_once():
    delivery = read_delivery(QUEUE, b"{}", {"application_headers": {}}, {"routing_key": EVENT_KEY})
    headers = _headers(_plan(delivery, BOOM))
    assert headers[wire.FIRST_FAILURE_AT].endswith("+00:00")
    assert (headers[wire.ATTEMPTS], headers[wire.ROUTING_KEY]) == (1, EVENT_KEY)


@pytest.mark.parametrize("outcome, redeliveries", [(Outcome(REDELIVERED), 3), (Outcome(DEFERRED, delay_ms=100), 2)])
def test_a_requeue_spends_no_attempt(outcome, redeliveries):
    headers = _headers(_plan(_delivery(attempts=2, redeliveries=2), outcome))
    assert headers[wire.ATTEMPTS] == 2  # this delivery was attempt 3; the next is attempt 3 again
    assert headers[wire.REDELIVERIES] == redeliveries
    assert wire.LAST_ERROR not in headers


@pytest.mark.parametrize("outcome, attempt, redeliveries", [
    (BOOM, 4, 2),  # a failure spends the attempt
    (Outcome(LOST, "pool process lost"), 4, 2),
    (Outcome(REDELIVERED), 3, 3),  # a broker redelivery spends none: it may never have reached the handler
    (Outcome(DEFERRED, delay_ms=100), 3, 2),
])
def test_a_held_partition_reruns_with_the_counters_its_copy_through_the_ladder_would_carry(outcome, attempt,
                                                                                          redeliveries):
    delivery = _delivery(attempts=2, redeliveries=2)  # attempt 3
    step = _plan(delivery, outcome, hold=True)
    assert isinstance(step, Rerun)
    assert (step.attempt, step.redeliveries) == (attempt, redeliveries)
    ladder = _plan(delivery, outcome)
    assert (_headers(ladder)[wire.ATTEMPTS] + 1, _headers(ladder)[wire.REDELIVERIES]) == (attempt, redeliveries)


def test_a_held_event_redelivered_too_often_is_archived_not_rerun():
    step = _plan(_delivery(attempts=0, redeliveries=MAX_RETRIES + 1), Outcome(REDELIVERED), hold=True)
    assert isinstance(step, Republish) and step.action == "archive"


@pytest.mark.parametrize("attempts, outcome, in_place_ms, expected", [
    (2, BOOM, 500, ("rerun", 400, 4)),  # attempt 3 failed: its retry waits 400 ms, within 500: in the worker
    (2, BOOM, 400, ("rerun", 400, 4)),  # at the bound
    (2, BOOM, 399, ("retry", 400, None)),  # longer than the bound: through the ladder
    (1, BOOM, 200, ("rerun", 200, 3)),
    (2, BOOM, 0, ("retry", 400, None)),  # off
    (MAX_RETRIES, BOOM, 60_000, ("archive", 0, None)),  # the last attempt: archived as ever
    (2, Outcome(REDELIVERED), 60_000, ("requeue", 0, None)),  # the redelivery counter lives in the copy's header
    (2, Outcome(DEFERRED, delay_ms=100), 60_000, ("requeue", 100, None)),  # a deferral is no retry
    (0, Outcome(RETRY, delay_ms=300), 500, ("rerun", 300, 2)),  # the handler's own delay, within the bound
])
def test_a_retry_within_retry_in_place_ms_runs_again_in_the_worker(attempts, outcome, in_place_ms, expected):
    step = _plan(_delivery(attempts=attempts, redeliveries=1), outcome, in_place_ms=in_place_ms)
    assert (step.action, step.delay_ms, getattr(step, "attempt", None)) == expected
    if isinstance(step, Rerun):
        assert step.redeliveries == 1


def test_an_archived_copy_says_why_where_from_and_after_how_many_attempts():
    outcome = Outcome(ARCHIVE, "order cancelled", "kombu_events.errors.Archive: order cancelled", "Traceback ...")
    headers = _headers(_plan(_delivery(attempts=1), outcome))
    assert {k: headers[k] for k in (wire.ATTEMPTS, wire.QUEUE, wire.ROUTING_KEY, wire.REASON, wire.EXCEPTION,
                                    wire.TRACEBACK)} == {
        wire.ATTEMPTS: 2, wire.QUEUE: QUEUE, wire.ROUTING_KEY: EVENT_KEY, wire.REASON: "order cancelled",
        wire.EXCEPTION: "kombu_events.errors.Archive: order cancelled", wire.TRACEBACK: "Traceback ...",
    }
    assert headers[wire.ARCHIVED_AT].endswith("+00:00")
    assert re.fullmatch(r"[0-9a-f]{20}", headers[wire.ARCHIVE_KEY])


def test_every_archived_copy_has_a_key_of_its_own():
    # The message id is the publisher's and not unique: replay and purge act on the archive key.
    outcome = Outcome(ARCHIVE, "order cancelled")
    keys = {_headers(_plan(_delivery(attempts=1), outcome))[wire.ARCHIVE_KEY] for _ in range(50)}
    assert len(keys) == 50
    earlier = _delivery(attempts=1, **{wire.ARCHIVE_KEY: "0" * 20})  # a replayed copy archived again
    assert _headers(_plan(earlier, outcome))[wire.ARCHIVE_KEY] != "0" * 20


@pytest.mark.parametrize("user_id, userid, sent", [
    (USERID, USERID, USERID),
    ("someone-else", USERID, USERID),  # the broker accepts only the connection's own: the copy is the worker's
    (USERID, None, None),
])
@pytest.mark.parametrize("outcome", [BOOM, Outcome(ARCHIVE, "x"), Outcome(DEFERRED)], ids=["retry", "archive",
                                                                                          "requeue"])
def test_a_copy_carries_the_connections_own_user_id_or_none(user_id, userid, sent, outcome):
    step = _plan(_delivery(user_id=user_id), outcome, userid=userid)
    while isinstance(step, Republish):
        assert step.properties.get("user_id") == sent
        step = step.if_refused(NACKED)


def test_invalid_utf8_routing_key_is_archived_under_its_original_bytes():
    delivery = read_delivery(QUEUE, b"{}", {}, {"routing_key": wire.Undecoded.of(b"orders.\xff")})
    assert delivery.unreadable == "routing key is not valid UTF-8"
    step = _plan(delivery, Outcome(UNDECODABLE, delivery.unreadable))
    assert _summary(step) == (Republish, "archive", "billing.archive", b"orders.\xff", 0)
    stripped = step.if_refused(NACKED)
    assert stripped.routing_key == b"orders.\xff"


@pytest.mark.parametrize("where", ["routing key header", "message_id", "delivered routing key"])
def test_text_py_amqp_decoded_with_surrogatepass_still_gets_a_plan(where):
    # b"\xed\xa0\x80" is how CESU-8 / Java's modified UTF-8 send a surrogate; py-amqp decodes it, without
    # raising, as "\ud800" -- and the guard never sees it. Whatever the planner does, it must not raise.
    text = b"orders.\xed\xa0\x80".decode("utf-8", "surrogatepass")
    headers = {wire.ROUTING_KEY: text} if where == "routing key header" else {}
    properties = {"application_headers": headers, "message_id": text if where == "message_id" else "m-1"}
    key = text if where == "delivered routing key" else EVENT_KEY
    delivery = read_delivery(QUEUE, b"{}", properties, {"routing_key": key})
    step = _plan(delivery, Outcome(ARCHIVE, "x"))
    assert isinstance(step, Republish)


@pytest.mark.parametrize("headers", [[1, 2], "x-request-id=r1", 7, b"\x00"])
def test_a_delivery_whose_headers_are_not_a_table_is_archived(headers):
    delivery = read_delivery(QUEUE, b"{}", {"application_headers": headers}, {"routing_key": EVENT_KEY})
    assert delivery.unreadable.startswith("unreadable header 'application_headers'")
    step = _plan(delivery, Outcome(UNDECODABLE, delivery.unreadable))
    assert _summary(step) == (Republish, "archive", "billing.archive", EVENT_KEY, 0)
    assert [s.action for s in _chain(step)] == ["archive", "archive", "held"]


RETRIED = {name: case for name, case in REPUBLISHED.items() if case[3][1] != "archive"}


@pytest.mark.parametrize("attempts, redeliveries, outcome, expected, reason", RETRIED.values(), ids=RETRIED.keys())
def test_the_copy_reads_back_as_the_next_delivery(attempts, redeliveries, outcome, expected, reason):
    delivery = _delivery(attempts=attempts, redeliveries=redeliveries)
    step = _plan(delivery, outcome)
    back = read_delivery(QUEUE, delivery.body, step.properties, {"routing_key": step.routing_key})
    assert (back.unreadable, back.routing_key, back.attempt, back.redeliveries) == (
        "", EVENT_KEY, delivery.attempt + (step.action == "retry"), redeliveries + (outcome.kind == REDELIVERED))


@pytest.mark.parametrize("outcome", [BOOM, Outcome(DEFERRED)], ids=["retry", "requeue"])
def test_an_event_with_an_empty_routing_key_comes_back_readable(outcome):
    delivery = read_delivery(QUEUE, b"{}", {}, {"routing_key": ""})  # a '#' binding matches the empty key
    step = _plan(delivery, outcome)
    back = read_delivery(QUEUE, b"{}", step.properties, {"routing_key": step.routing_key})
    assert (back.unreadable, back.routing_key) == ("", "")


# -- when the broker refuses a copy --------------------------------------------------------------

def _chain(step: Step, why: str = NACKED) -> list[Step]:
    """``step`` and every step after it when each copy is refused with ``why``."""
    steps = [step]
    while isinstance(steps[-1], Republish):
        steps.append(steps[-1].if_refused(why))
        assert len(steps) < 10, "the fallback chain must end"
    return steps


@pytest.mark.parametrize("attempts, redeliveries, outcome, expected, reason", REPUBLISHED.values(),
                         ids=REPUBLISHED.keys())
def test_every_refusal_ends_in_hold_via_the_archive(attempts, redeliveries, outcome, expected, reason):
    first = _plan(_delivery(attempts=attempts, redeliveries=redeliveries), outcome)
    steps = _chain(first)
    actions = [step.action for step in steps]
    if first.action == "archive":
        assert actions == ["archive", "archive", "held"]
    else:
        assert actions == [first.action, "archive", "archive", "held"]
    *_, archived, stripped, held = steps
    assert reason in archived.reason
    assert (stripped.exchange, stripped.routing_key, stripped.delay_ms) == ("billing.archive", EVENT_KEY, 0)
    assert stripped.reason == archived.reason
    assert isinstance(held, Hold)
    assert held.reason == f"archive publish failed ({NACKED}); message left unacked: {archived.reason}"


@pytest.mark.parametrize("name", [name for name, case in REPUBLISHED.items() if case[3][1] != "archive"])
def test_a_refused_retry_or_requeue_is_archived_saying_so(name):
    attempts, redeliveries, outcome, (_, action, *_), reason = REPUBLISHED[name]
    archived = _plan(_delivery(attempts=attempts, redeliveries=redeliveries), outcome).if_refused(NACKED)
    assert (type(archived), archived.action, archived.exchange, archived.routing_key) == (
        Republish, "archive", "billing.archive", EVENT_KEY)
    assert archived.reason.startswith(f"{action} publish failed ({NACKED}); {reason}")
    headers = _headers(archived)
    assert headers[wire.REASON] == archived.reason
    assert {k: headers[k] for k in USER_HEADERS} == USER_HEADERS
    assert "x-death" not in headers


@pytest.mark.parametrize("attempts, redeliveries, outcome, expected, reason", REPUBLISHED.values(),
                         ids=REPUBLISHED.keys())
def test_a_refused_archive_is_tried_with_the_librarys_headers_only(attempts, redeliveries, outcome, expected,
                                                                   reason):
    delivery = _delivery(attempts=attempts, redeliveries=redeliveries)
    *_, archived, stripped, _held = _chain(_plan(delivery, outcome))
    headers = _headers(stripped)
    assert set(headers) <= LIBRARY_HEADERS
    assert not set(USER_HEADERS) & set(headers)
    assert "x-death" not in headers
    assert NACKED in headers[wire.DROPPED_HEADERS]
    assert headers[wire.REASON] == archived.reason
    assert (headers[wire.ATTEMPTS], headers[wire.QUEUE], headers[wire.ROUTING_KEY]) == (
        delivery.attempt, QUEUE, EVENT_KEY)
    assert headers[wire.TRACEBACK] == ""
    assert headers[wire.EXPIRATION] == "60000"
    assert re.fullmatch(r"[0-9a-f]{20}", headers[wire.ARCHIVE_KEY])
    assert stripped.properties["message_id"] == "m-1"
    assert stripped.properties["correlation_id"] == b"c-\xff"


def test_the_refusal_reason_travels_down_the_chain():
    step = _plan(_delivery(), BOOM)
    archived = step.if_refused("returned: NO_ROUTE")
    assert "retry publish failed (returned: NO_ROUTE)" in archived.reason
    stripped = archived.if_refused("publish raised FrameSyntaxError: bad table")
    assert "FrameSyntaxError: bad table" in _headers(stripped)[wire.DROPPED_HEADERS]
    held = stripped.if_refused("connection lost")
    assert held == Hold(f"archive publish failed (connection lost); message left unacked: {archived.reason}")


def test_a_default_republish_holds_when_refused():
    step = Republish("archive", "billing.archive", EVENT_KEY, {})
    assert step.if_refused("nacked") == Hold("nacked")


# -- purity --------------------------------------------------------------------------------------

@pytest.mark.parametrize("attempts, redeliveries, outcome, expected, reason", CASES.values(), ids=CASES.keys())
def test_planning_never_changes_the_delivery(attempts, redeliveries, outcome, expected, reason):
    delivery = _delivery(attempts=attempts, redeliveries=redeliveries)
    before = copy.deepcopy(delivery.properties)
    for step in _chain(_plan(delivery, outcome)):
        if isinstance(step, Republish):
            assert step.properties["application_headers"] is not delivery.headers
            step.properties["application_headers"]["added-later"] = 1  # a middleware may change a copy
    assert delivery.properties == before


def test_jittered_delays_are_deterministic_for_a_fixed_random_source():
    backoff = Exponential(base_ms=1000, factor=2, max_delay_ms=25_500, jitter=0.5)

    def step(r: float) -> Republish:
        return _plan(_delivery(attempts=0), BOOM, backoff=backoff, rand=lambda: r)

    assert [_summary(step(r)) for r in (0.0, 0.5, 1.0)] == [
        (Republish, "retry", "billing.delay.3", "0.0.0.0.1.0.1.0.billing.audit", 1000),
        (Republish, "retry", "billing.delay.3", "0.0.0.0.1.0.0.0.billing.audit", 800),  # 750 ms -> 8 units
        (Republish, "retry", "billing.delay.2", "0.0.0.0.0.1.0.1.billing.audit", 500),
    ]
    assert step(0.37) == step(0.37)


# -- many handler queues: every copy comes back to the queue that failed, and only there -------------

#: Handler queues that are prefixes, suffixes and look-alikes of each other; the first is first in the topology,
#: so a retry sent to "the service's first queue" instead of its own is caught by every other one.
LOOK_ALIKES = ("svc.a", "svc.a.b", "svc.ab", "svc.b.a", "svc.a.b.c", "svc", "a", "x.svc.a", "1.svc.a",
               "0.1.svc.a", "svc.delay", "svc.b")
#: Binding keys that overlap: one event reaches many of the queues.
OVERLAPPING_KEYS = ("orders.#", "#", "orders.*", "*.created", "orders.*.created", "#.created", "orders.#.created")
MANY = resolve_settings("svc", environ={}, delay_unit_ms=100, delay_levels=8)


def _handlers(queues, keys=OVERLAPPING_KEYS) -> list[Handler]:
    return [Handler(fn=lambda payload: None, name=queue, queue=queue, binding_keys=(keys[i % len(keys)],),
                    max_retries=MAX_RETRIES, backoff=BACKOFF) for i, queue in enumerate(queues)]


MANY_TOPOLOGY = build_topology(MANY, _handlers(LOOK_ALIKES))
MANY_BROKER = BrokerModel([MANY_TOPOLOGY])

#: Outcome -> what the copy is: every outcome that sends a message back to its queue through the ladder.
SENT_BACK = {
    "failed": (BOOM, "retry"),
    "retry with a delay": (Outcome(RETRY, "later", delay_ms=1234), "retry"),
    "lost": (Outcome(LOST, "pool process lost"), "retry"),
    "deferred": (Outcome(DEFERRED, "circuit open", delay_ms=5000), "requeue"),
    "deferred without a delay": (Outcome(DEFERRED, delay_ms=0), "requeue"),
    "redelivered": (Outcome(REDELIVERED, "redelivered"), "requeue"),
}


def _from(queue: str, *, attempts: int = 1, key: str = EVENT_KEY) -> Delivery:
    """A delivery of ``queue``, back from the ladder after ``attempts`` failed attempts."""
    headers = {wire.ATTEMPTS: attempts, wire.ROUTING_KEY: key, "tenant": "acme"}
    return read_delivery(queue, b"{}", {"message_id": f"m-{queue}", "application_headers": headers},
                         {"routing_key": key})


def _comes_back(step: Step, delivery: Delivery, topology: Topology, broker: BrokerModel) -> None:
    """The copy of ``step`` lands in ``delivery.queue`` only, after the delay it says, and reads back as the next."""
    assert isinstance(step, Republish) and step.action in ("retry", "requeue"), step
    routed = broker.follow(step.exchange, step.routing_key)
    assert routed.lost == ()
    [landing] = routed.landings
    assert landing.queue == delivery.queue, f"{step.action} of {delivery.queue!r} landed in {landing.queue!r}"
    assert landing.after_ms == step.delay_ms
    expected_levels = [names.delay_name(topology.settings.service, level) for level in
                       range(topology.settings.delay_levels - 1, -1, -1) if step.delay_ms // 100 >> level & 1]
    assert list(landing.waited_in) == expected_levels
    back = read_delivery(landing.queue, delivery.body, step.properties, {"routing_key": landing.routing_key})
    assert (back.unreadable, back.routing_key, back.headers["tenant"]) == ("", delivery.routing_key, "acme")
    assert back.attempt == delivery.attempt + (step.action == "retry")


@pytest.mark.parametrize("outcome, action", SENT_BACK.values(), ids=SENT_BACK.keys())
@pytest.mark.parametrize("queue", LOOK_ALIKES)
def test_among_look_alike_queues_a_copy_comes_back_to_its_own_queue_only(queue, outcome, action):
    delivery = _from(queue)
    step = _plan(delivery, outcome, topology=MANY_TOPOLOGY)
    assert step.action == action
    assert step.routing_key.endswith("." + queue)
    _comes_back(step, delivery, MANY_TOPOLOGY, MANY_BROKER)


@pytest.mark.parametrize("queue", LOOK_ALIKES)
def test_a_rejected_message_comes_back_to_its_own_queue_only(queue):
    """What the broker does with a message a worker rejects, or whose process dies: the queue's dead-letter route."""
    args = {q.name: q.queue_arguments for q in MANY_TOPOLOGY.queues}[queue]
    routed = MANY_BROKER.follow(args["x-dead-letter-exchange"], args["x-dead-letter-routing-key"])
    assert [(landing.queue, landing.after_ms) for landing in routed.landings] == [(queue, 100)]


@pytest.mark.parametrize("queue", LOOK_ALIKES)
def test_among_look_alike_queues_an_archived_copy_goes_to_the_archive_only(queue):
    delivery = _from(queue, attempts=MAX_RETRIES)
    step = _plan(delivery, BOOM, topology=MANY_TOPOLOGY)
    for copy_ in _chain(step)[:-1]:
        assert copy_.action == "archive"
        routed = MANY_BROKER.follow(copy_.exchange, copy_.routing_key)
        assert [landing.queue for landing in routed.landings] == ["svc.archive"]
        assert _headers(copy_)[wire.QUEUE] == queue


def test_an_event_reaches_the_overlapping_queues_and_each_retry_only_its_own():
    reached = MANY_BROKER.route("events", "orders.7.created")
    assert reached[0] == LOOK_ALIKES[0] and len(reached) == 8, "one event, many look-alike queues"
    landed = []
    for queue in reached:
        step = _plan(_from(queue, key="orders.7.created"), BOOM, topology=MANY_TOPOLOGY)
        landed += [landing.queue for landing in MANY_BROKER.follow(step.exchange, step.routing_key).landings]
    assert landed == list(reached)


# Queue names built from a few words, so that many are prefixes, suffixes or look-alikes of each other.
WORDS = st.sampled_from(["svc", "a", "b", "ab", "0", "1", "delay", "x"])
QUEUE_NAMES = st.lists(WORDS, min_size=1, max_size=4).map(".".join)
BINDING_KEYS = st.lists(st.sampled_from(["orders", "*", "#", "created", "a", "svc"]), min_size=1, max_size=4).map(
    ".".join)
KINDS = st.sampled_from([FAILED, RETRY, LOST, DEFERRED, REDELIVERED])


def _is_handler_queue(topology: Topology, queue: str) -> bool:
    return topology.role(queue) == "handler"


@settings(max_examples=60, deadline=None)
@example(queues=["svc.a", "svc.a.b", "svc.ab"], keys=["#", "#", "#"], levels=1, picked=2, kind=FAILED, delay=0,
         attempts=1)
@example(queues=["svc", "0.svc", "1.0.svc"], keys=["*.#", "#.svc", "*"], levels=2, picked=0, kind=RETRY, delay=300,
         attempts=2)
@given(queues=st.lists(QUEUE_NAMES, min_size=2, max_size=8, unique=True),
       keys=st.lists(BINDING_KEYS, min_size=8, max_size=8), levels=st.integers(1, 10), picked=st.integers(0, 7),
       kind=KINDS, delay=st.integers(0, 2_000), attempts=st.integers(0, MAX_RETRIES - 1))
def test_property_each_retry_among_look_alike_queues_comes_back_to_its_own_queue(queues, keys, levels, picked, kind,
                                                                                 delay, attempts):
    service = resolve_settings("svc", environ={}, delay_unit_ms=100, delay_levels=levels)
    probe = build_topology(service, [])
    queues = [q for q in queues if _is_handler_queue(probe, q)]  # not the ladder's, the archive's, a schedule's
    if not queues:
        return
    topology = build_topology(service, _handlers(queues, keys))
    delivery = _from(queues[picked % len(queues)], attempts=attempts)
    delay_ms = min(delay, service.max_delay_ms)
    step = _plan(delivery, Outcome(kind, "why", delay_ms=delay_ms), topology=topology,
                 backoff=Exponential(base_ms=100, max_delay_ms=service.max_delay_ms))
    _comes_back(step, delivery, topology, BrokerModel([topology]))
