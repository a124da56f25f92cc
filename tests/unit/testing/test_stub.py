"""The test kit's stub: the worker's own code over an in-memory broker and a virtual clock (no socket)."""
from __future__ import annotations

import dataclasses
import itertools

import celery
import pytest
from hypothesis import given, settings, strategies as st

from kombu_events import (
    Archive,
    ConfigurationError,
    Events,
    Exponential,
    KombuEventsError,
    Middleware,
    Outcome,
    Retry,
    UnroutableError,
    poisonous,
    signals,
)
from kombu_events.core import wire
from kombu_events.core.decision import DEFERRED, FAILED, UNDECODABLE
from kombu_events.core.settlement import Republish
from kombu_events.publishing.publisher import Publisher
from kombu_events.testing import StubEvents, fails_fast, stub as stub_module

FAST = {"delay_unit_ms": 100, "delay_levels": 8, "backoff": Exponential(base_ms=200, max_delay_ms=1000)}


@pytest.fixture
def events(app, monkeypatch):
    monkeypatch.delenv("AMQP_EVENTS_MAX_RETRIES", raising=False)
    return Events(app, "billing", **FAST)


def actions(stub: StubEvents) -> list[tuple[str, str, int]]:
    return [(s.action, s.queue, s.attempt) for s in stub.settled]


# -- routing --------------------------------------------------------------------------------------


def test_a_hash_binding_matches_the_key_without_more_words(events):
    @events.handler("orders.#")
    def audit(payload):
        pass

    @events.handler("orders.*")
    def one_word(payload):
        pass

    stub = StubEvents(events)
    stub.publish("orders", {"n": 1})
    stub.join()
    assert stub.calls(audit) == [{"n": 1}]
    assert stub.calls(one_word) == []
    assert stub.published[0].queues == ("billing.audit",)


def test_every_service_of_the_app_gets_the_event_and_each_queue_one_copy(app, events):
    shipping = Events(app, "shipping")

    @events.handler("orders.*.created", "orders.#")  # two matching keys, one queue: one copy
    def charge(payload):
        pass

    @shipping.handler("orders.*.created")
    def ship(payload):
        pass

    @shipping.handler("refunds.#")
    def refund(payload):
        pass

    stub = StubEvents(events)
    stub.publish("orders.7.created", {"order_id": 7})
    stub.join()
    assert stub.calls(charge) == stub.calls(ship) == [{"order_id": 7}]
    assert stub.calls(refund) == []
    assert sorted(s.queue for s in stub.acked) == ["billing.charge", "shipping.ship"]


def test_services_on_another_exchange_do_not_get_the_event(app, events):
    other = Events(app, "other", exchange="elsewhere")

    @events.handler("orders.#")
    def here(payload):
        pass

    @other.handler("orders.#")
    def there(payload):
        pass

    stub = StubEvents(events)
    stub.publish("orders.1", {})
    stub.publish("orders.2", {}, exchange="elsewhere")
    stub.join()
    assert stub.calls(here) == [{}]
    assert stub.calls(there) == [{}]
    with pytest.raises(ConfigurationError, match="pass exchange="):
        StubEvents(app).publish("orders.3", {})


def test_an_unroutable_event_raises_unless_not_mandatory(events):
    @events.handler("orders.#")
    def audit(payload):
        pass

    stub = StubEvents(events)
    with pytest.raises(UnroutableError) as raised:
        stub.publish("refunds.1", {})
    assert (raised.value.exchange, raised.value.routing_key) == ("events", "refunds.1")
    stub.publish("refunds.2", {}, mandatory=False)
    assert [p.queues for p in stub.published] == [(), ()]
    assert stub.pending == []


def test_an_app_without_services_is_refused(app):
    with pytest.raises(ConfigurationError, match="no Events service"):
        StubEvents(app)


def test_the_stub_runs_its_own_apps_handler_when_another_app_has_the_same_queue(events):
    other_app = celery.Celery("other", broker="memory://", set_as_current=False)
    other = Events(other_app, "billing", **FAST)
    called = []

    @other.handler("orders.#", name="audit")
    def theirs(payload):
        called.append("theirs")

    @events.handler("orders.#", name="audit")
    def ours(payload):
        called.append("ours")

    StubEvents(other).publish("orders.1", {})  # resolves other_app's routes first
    stub = StubEvents(events)
    stub.publish("orders.1", {})
    stub.join()
    assert called == ["ours"]


# -- what a handler gets ----------------------------------------------------------------------------


def test_handlers_get_the_payload_an_event_or_the_raw_body(events):
    @events.handler("orders.#")
    def plain(payload):
        pass

    @events.handler("orders.#", bind=True)
    def bound(event):
        pass

    @events.handler("orders.#", raw=True)
    def raw(body):
        pass

    stub = StubEvents(events)
    message_id = stub.publish("orders.1.created", {"n": 1}, headers={"x-request-id": "r-1"},
                              correlation_id="c-1", properties={"app_id": "shop"})
    stub.join()
    assert stub.calls(plain) == [{"n": 1}]
    assert stub.calls(raw) == [b'{"n":1}']
    [event] = stub.calls(bound)
    assert (event.payload, event.routing_key, event.queue, event.attempt) == ({"n": 1}, "orders.1.created",
                                                                               "billing.bound", 1)
    assert event.message_id == message_id and event.correlation_id == "c-1"
    assert event.headers == {"x-request-id": "r-1"} and event.properties["app_id"] == "shop"


def test_calls_refuses_a_function_that_is_no_handler(events):
    @events.handler("orders.#")
    def audit(payload):
        pass

    def helper(payload):
        pass

    with pytest.raises(ConfigurationError, match="is not a handler"):
        StubEvents(events).calls(helper)


def test_raw_bodies_and_content_type_overrides(events):
    @events.handler("orders.#")
    def audit(payload):
        pass

    stub = StubEvents(events)
    stub.publish("orders.1", b'{"a": [1]}')
    stub.publish("orders.2", b'{"b": 2}', content_type=None, content_encoding=None)  # tried as JSON
    stub.publish("orders.3", b"<order/>", content_type="application/xml")
    stub.join()
    assert stub.calls(audit) == [{"a": [1]}, {"b": 2}]
    [archived] = stub.archived
    assert archived.reason.startswith("content type 'application/xml' is not accepted")
    assert archived.outcome.kind == UNDECODABLE and archived.body == b"<order/>"


def test_an_undecodable_body_is_archived_and_the_handler_never_runs(events):
    @events.handler("orders.#")
    def audit(payload):
        pass

    stub = StubEvents(events)
    stub.publish("orders.1", b"{not json")
    stub.join()
    assert stub.calls(audit) == []
    [archived] = stub.archived
    assert archived.reason.startswith("body is not valid JSON")
    assert archived.headers[wire.REASON] == archived.reason
    assert archived.headers[wire.QUEUE] == "billing.audit" and archived.headers[wire.ATTEMPTS] == 1


def test_an_unreadable_header_is_archived_naming_it(events):
    @events.handler("orders.#")
    def audit(payload):
        pass

    stub = StubEvents(events)
    stub.publish("orders.1", {}, headers={wire.ATTEMPTS: "three"})
    stub.join()
    assert stub.calls(audit) == []
    assert stub.archived[0].reason.startswith(f"unreadable header {wire.ATTEMPTS!r}")


# -- the failure policy, on the virtual clock ----------------------------------------------------------


def test_retry_then_succeed_follows_the_backoff_on_the_virtual_clock(events):
    @events.handler("orders.#", bind=True)
    def flaky(event):
        if event.attempt < 3:
            raise RuntimeError(f"failure {event.attempt}")

    stub = StubEvents(events)
    stub.publish("orders.1.created", {"n": 1}, headers={"tenant": "acme"})
    stub.join(fail_fast=False)
    assert [(r.attempt, r.delay_ms, r.reason) for r in stub.retried] == [(1, 200, "builtins.RuntimeError: failure 1")]
    assert [(p.due, p.queue, p.routing_key) for p in stub.pending] == [(0.2, "billing.flaky", "orders.1.created")]
    stub.advance(0.1)
    assert len(stub.settled) == 1 and stub.now == 0.1
    stub.advance(0.1, fail_fast=False)
    assert [(r.attempt, r.delay_ms, r.at) for r in stub.retried] == [(1, 200, 0.0), (2, 400, 0.2)]
    stub.advance(10)
    assert [(a.attempt, a.at) for a in stub.acked] == [(3, 0.6)]
    assert stub.now == 10.2 and stub.pending == []
    attempts = [e.attempt for e in stub.calls(flaky)]
    assert attempts == [1, 2, 3]
    last = stub.calls(flaky)[-1]
    assert last.routing_key == "orders.1.created" and last.headers["tenant"] == "acme"
    assert last.headers[wire.ATTEMPTS] == 2 and last.headers[wire.LAST_ERROR] == "builtins.RuntimeError: failure 2"


def test_advance_handles_retries_that_come_due_within_the_same_advance(events):
    @events.handler("orders.#", max_retries=3)
    def always(payload):
        raise RuntimeError("always")

    stub = StubEvents(events)
    stub.publish("orders.1", {})
    stub.advance(60, fail_fast=False)
    assert [(s.action, s.attempt, s.at) for s in stub.settled] == [
        ("retry", 1, 0.0), ("retry", 2, 0.2), ("retry", 3, 0.6), ("archive", 4, 1.4)]
    [archived] = stub.archived
    assert archived.reason == "gave up after 4 attempts (max_retries=3): builtins.RuntimeError: always"
    assert archived.headers[wire.REASON] == archived.reason and archived.headers[wire.ATTEMPTS] == 4
    assert archived.headers[wire.EXCEPTION] == "builtins.RuntimeError: always"
    assert "RuntimeError: always" in archived.headers[wire.TRACEBACK]
    assert archived.headers[wire.ROUTING_KEY] == "orders.1" and archived.payload == {}


# -- the archive: a stream of copies under archive keys, settled by replay and purge ---------------------


def test_an_archived_copy_is_appended_to_the_archive_under_a_key_of_its_own(events):
    @events.handler("orders.#", max_retries=0)
    def always(payload):
        raise RuntimeError("always")

    stub = StubEvents(events)
    for n in (1, 2):
        stub.publish("orders.1", {"n": n}, message_id="same-id")  # a message id is not unique: the key is
    stub.join(fail_fast=False)
    first, second = stub.archive()
    assert [c.payload for c in (first, second)] == [{"n": 1}, {"n": 2}]
    assert [c.offset for c in (first, second)] == [0, 1] and first.key != second.key
    assert [c.key for c in (first, second)] == [a.headers[wire.ARCHIVE_KEY] for a in stub.archived]
    assert (first.queue, first.routing_key, first.message_id) == ("billing.always", "orders.1", "same-id")
    assert first.reason == stub.archived[0].reason == first.headers[wire.REASON]


def test_purge_hides_the_copies_it_settles_and_keeps_them_in_the_stream(events):
    @events.handler("orders.#", max_retries=0)
    def always(payload):
        raise RuntimeError("always")

    stub = StubEvents(events)
    for n in range(3):
        stub.publish("orders.1", {"n": n})
    stub.join(fail_fast=False)
    purged = stub.purge(lambda c: c.payload["n"] != 1, by="ops", note="cleanup")
    assert [c.payload for c in purged] == [{"n": 0}, {"n": 2}]
    assert [c.payload for c in stub.archive()] == [{"n": 1}]
    assert stub.purge(lambda c: c.payload["n"] == 0) == []  # settled once: no longer listed
    records = stub._broker.streams["billing.archive"]
    assert len(records) == 4  # three copies and one settlement record: nothing was removed
    assert (records[3].action, records[3].keys, records[3].by, records[3].note) == (
        "purged", tuple(c.key for c in purged), "ops", "cleanup")


def test_replay_sends_each_copy_back_once_and_settles_it(events):
    fixed = []

    @events.handler("orders.#", max_retries=0, bind=True)
    def flaky(event):
        if not fixed:
            raise RuntimeError("not yet")
        fixed.append((event.payload, event.attempt, dict(event.headers)))

    stub = StubEvents(events)
    stub.publish("orders.7", {"n": 7}, headers={"tenant": "acme"})
    stub.join(fail_fast=False)
    [archived] = stub.archive()
    fixed.append("deployed")
    assert stub.replay() == [archived]
    assert stub.archive() == [] and stub.replay() == []  # settled: a second replay sends nothing
    stub.join()
    [(payload, attempt, headers)] = fixed[1:]
    assert (payload, attempt, headers["tenant"]) == ({"n": 7}, 1, "acme")
    assert headers[wire.REPLAY_OF] == archived.key
    assert not {wire.ARCHIVE_KEY, wire.REASON, wire.ATTEMPTS} & set(headers)
    settlement = stub._broker.streams["billing.archive"][-1]
    assert (settlement.action, settlement.keys, dict(settlement.detail)) == (
        "replayed", (archived.key,), {archived.key: "billing.flaky"})


def test_replay_to_a_queue_that_is_not_the_services_keeps_the_copy_archived(events):
    @events.handler("orders.#", max_retries=0)
    def always(payload):
        raise RuntimeError("always")

    stub = StubEvents(events)
    stub.publish("orders.1", {})
    stub.join(fail_fast=False)
    assert stub.replay(to_queue="someone.else") == []
    assert len(stub.archive()) == 1 and stub.pending == []


def test_the_archive_of_an_app_with_two_services_needs_events(app, events):
    shipping = Events(app, "shipping")

    @shipping.handler("orders.#", max_retries=0)
    def ship(payload):
        raise RuntimeError("no")

    stub = StubEvents(app)
    stub.publish("orders.1", {}, exchange="events")
    stub.join(fail_fast=False)
    with pytest.raises(ConfigurationError, match="pass events="):
        stub.archive()
    assert [c.queue for c in stub.archive(shipping)] == ["shipping.ship"] and stub.archive(events) == []


def test_retry_with_a_delay_waits_that_long(events):
    @events.handler("orders.#", bind=True)
    def later(event):
        if event.attempt == 1:
            raise Retry(delay=2.5)

    stub = StubEvents(events)
    stub.publish("orders.1", {})
    stub.join()
    assert [(r.delay_ms, r.reason) for r in stub.retried] == [(2500, "retry in 2.5 s")]
    stub.advance(2.4)
    assert stub.acked == []
    stub.advance(0.1)
    assert [a.attempt for a in stub.acked] == [2]


def test_archive_and_poisonous_archive_at_once(events):
    @events.handler("orders.#")
    def cancelled(payload):
        raise Archive("order cancelled")

    @events.handler("orders.#")
    def poisoned(payload):
        with poisonous():
            int("not a number")

    stub = StubEvents(events)
    stub.publish("orders.1", {})
    stub.join()
    reasons = {a.queue: a.reason for a in stub.archived}
    assert reasons["billing.cancelled"] == "order cancelled"
    assert reasons["billing.poisoned"].startswith("poisonous section failed: ValueError: invalid literal")
    assert stub.retried == []


def test_a_delay_the_ladder_cannot_hold_is_archived(events):
    @events.handler("orders.#")
    def too_late(payload):
        raise Retry(delay=3600)

    stub = StubEvents(events)
    stub.publish("orders.1", {})
    stub.join()
    assert stub.archived[0].reason.startswith("retry delay 3600000.0 ms exceeds the ladder's")


def test_jitter_uses_the_given_random_source(app):
    events = Events(app, "billing", delay_unit_ms=100, delay_levels=8,
                    backoff=Exponential(base_ms=1000, max_delay_ms=1000, jitter=0.5))

    @events.handler("orders.#")
    def fails(payload):
        raise RuntimeError("boom")

    stub = StubEvents(events, rand=lambda: 1.0)
    stub.publish("orders.1", {})
    stub.join(fail_fast=False)
    assert stub.retried[0].delay_ms == 500


def test_a_handler_that_changes_its_event_does_not_change_the_retried_copy(events):
    @events.handler("orders.#", bind=True)
    def meddles(event):
        event.headers["tenant"] = "changed"
        if event.attempt == 1:
            raise Retry(delay=0)

    stub = StubEvents(events)
    stub.publish("orders.1", {}, headers={"tenant": "acme"})
    stub.join()
    assert stub.retried[0].headers["tenant"] == "acme"
    assert [s.action for s in stub.settled] == ["retry", "ack"], "a zero delay comes due in the same join"


def test_a_failed_handler_gets_the_retry_and_the_other_handlers_of_the_event_do_not(events):
    """As a user would write it: two handlers of one event, the second fails once."""
    @events.handler("orders.#")
    def audit(payload):
        pass

    @events.handler("orders.*.created", bind=True)
    def charge(event):
        if event.attempt == 1:
            raise ConnectionError("payment provider down")

    stub = StubEvents(events)
    stub.publish("orders.7.created", {"order_id": 7})
    stub.join(fail_fast=False)
    stub.advance(1)
    assert [(e.attempt, e.payload) for e in stub.calls(charge)] == [(1, {"order_id": 7}), (2, {"order_id": 7})]
    assert stub.calls(audit) == [{"order_id": 7}]
    assert [(s.action, s.queue, s.attempt) for s in stub.settled] == [
        ("ack", "billing.audit", 1), ("retry", "billing.charge", 1), ("ack", "billing.charge", 2)]


def test_retries_among_look_alike_queues_each_come_back_to_their_own_handler(events):
    calls: dict[str, list[int]] = {}

    def flaky(name):
        def handler(event):
            calls.setdefault(name, []).append(event.attempt)
            if event.attempt <= len(name):  # each fails a different number of times
                raise Retry(delay=0.1 * len(name))
        return handler

    for name, key in (("a", "orders.#"), ("a.b", "#"), ("ab", "orders.*"), ("b.a", "#.created"), ("a.b.c", "*.*")):
        events.handler(key, queue=f"billing.{name}", name=name.replace(".", "_"), bind=True)(flaky(name))
    stub = StubEvents(events)
    stub.publish("orders.created", {})
    stub.advance(10)
    assert calls == {"a": [1, 2], "a.b": [1, 2, 3, 4], "ab": [1, 2, 3], "b.a": [1, 2, 3, 4],
                     "a.b.c": [1, 2, 3, 4, 5, 6]}
    assert stub.pending == [] and stub.lost == []


def _misplan(monkeypatch, **changes):
    """Make the stub's planner send every retry and requeue elsewhere, as a bug in the planner would."""
    planned = stub_module.plan

    def misplanned(*args, **kwargs):
        step = planned(*args, **kwargs)
        return step if not isinstance(step, Republish) or step.action == "archive" else dataclasses.replace(
            step, **{k: v(step) if callable(v) else v for k, v in changes.items()})

    monkeypatch.setattr(stub_module, "plan", misplanned)


def test_a_republish_no_queue_takes_is_returned_and_archived_as_in_the_worker(events, monkeypatch):
    @events.handler("orders.#")
    def fails(payload):
        raise RuntimeError("boom")

    _misplan(monkeypatch, exchange="billing.delivery",
             routing_key=lambda step: step.routing_key.replace("billing.fails", "billing.nobody"))
    stub = StubEvents(events)
    stub.publish("orders.1", {})
    stub.join(fail_fast=False)
    [archived] = stub.settled
    assert archived.action == "archive" and archived.queue == "billing.fails"
    assert archived.reason.startswith(
        "retry publish failed (returned by the broker: no queue is bound for it); builtins.RuntimeError: boom")
    assert stub.pending == [] and stub.lost == []


def test_a_copy_the_ladder_would_drop_stops_the_stub_and_is_recorded(events, monkeypatch):
    @events.handler("orders.#")
    def fails(payload):
        raise Retry(delay=0.25)

    _misplan(monkeypatch, routing_key=lambda step: step.routing_key.replace("billing.fails", "billing.gone"))
    stub = StubEvents(events)
    stub.publish("orders.1", {}, message_id="m-1")
    lost_at = r"message 'm-1' \(event 'orders.1'\) would be lost at t=0.3 s: it expires from queue 'billing.delay.0'"
    with pytest.raises(KombuEventsError, match=lost_at + r" into exchange 'billing.delivery'"):
        stub.join()
    [lost] = stub.lost
    assert (lost.at, lost.lost.queue, lost.lost.routing_key, lost.lost.why) == (
        0.3, "billing.delay.0", "0.0.0.0.0.0.1.1.billing.gone", "no queue is bound for it")
    assert [s.action for s in stub.settled] == ["retry"] and stub.pending == []
    stub.join()  # reported once


def test_a_republish_to_an_exchange_that_does_not_exist_is_archived(events, monkeypatch):
    @events.handler("orders.#")
    def fails(payload):
        raise RuntimeError("boom")

    _misplan(monkeypatch, exchange="billing.nowhere")
    stub = StubEvents(events)
    stub.publish("orders.1", {})
    stub.join(fail_fast=False)
    assert stub.archived[0].reason.startswith("retry publish failed (NOT_FOUND - no exchange 'billing.nowhere')")


def test_a_retry_routed_to_another_queue_runs_that_queues_handler(events, monkeypatch):
    """The stub follows the copy where the topology takes it: a misrouted retry is seen, not assumed home."""
    @events.handler("orders.#")
    def first(payload):
        pass

    @events.handler("orders.#", max_retries=1)
    def second(payload):
        raise RuntimeError("boom")

    _misplan(monkeypatch, routing_key=lambda step: step.routing_key.replace("billing.second", "billing.first"))
    stub = StubEvents(events)
    stub.publish("orders.1", {})
    stub.advance(1, fail_fast=False)
    assert stub.calls(first) == [{}, {}] and stub.calls(second) == [{}]


def test_a_requeue_without_a_delay_goes_through_the_delivery_exchange_to_its_queue_at_once(app):
    class Once(Middleware):
        def __init__(self) -> None:
            self.deferred: set[str] = set()

        def before_dispatch(self, delivery):
            if delivery.queue in self.deferred:
                return None
            self.deferred.add(delivery.queue)
            return Outcome(DEFERRED, "not yet", delay_ms=0)

    events = Events(app, "billing", middleware=[Once()], **FAST)

    @events.handler("orders.#")
    def later(payload):
        pass

    @events.handler("orders.#")
    def other(payload):
        pass

    stub = StubEvents(events)
    stub.publish("orders.1", {})
    stub.join()
    assert [(s.action, s.queue, s.delay_ms, s.at) for s in stub.settled] == [
        ("requeue", "billing.later", 0, 0.0), ("requeue", "billing.other", 0, 0.0),
        ("ack", "billing.later", 0, 0.0), ("ack", "billing.other", 0, 0.0)]


# -- fail_fast ---------------------------------------------------------------------------------------


class Declared(Exception):
    pass


def test_fail_fast_reraises_an_undeclared_exception_once_its_message_is_settled(events):
    boom = RuntimeError("boom")

    @events.handler("orders.#")
    def broken(payload):
        raise boom

    @events.handler("orders.#")
    def fine(payload):
        pass

    stub = StubEvents(events)
    stub.publish("orders.1", {})
    with pytest.raises(RuntimeError) as raised:
        stub.join()
    assert raised.value is boom
    assert actions(stub) == [("retry", "billing.broken", 1)]
    assert [p.queue for p in stub.pending] == ["billing.fine", "billing.broken"]
    stub.join(fail_fast=False)
    assert actions(stub)[-1] == ("ack", "billing.fine", 1)
    assert not signals.handler_failed.receivers and not signals.handler_started.receivers


@pytest.mark.parametrize("raise_, options, raised", [
    (lambda: Retry(delay=1), {}, False),
    (lambda: Archive("no"), {}, False),
    (lambda: Declared("declared"), {"dont_retry": Declared}, False),
    (lambda: KeyError("id"), {"retry_for": Declared}, True),  # archived, but nobody declared it
    (lambda: KeyError("id"), {"dont_retry": Declared}, True),
    (lambda: KeyError("id"), {"max_retries": 0}, True),  # archived at once: gave up after 1 attempt
])
def test_which_exceptions_fail_fast_reraises(events, raise_, options, raised):
    @events.handler("orders.#", **options)
    def handler(payload):
        raise raise_()

    stub = StubEvents(events)
    stub.publish("orders.1", {})
    if raised:
        with pytest.raises(KeyError):
            stub.join()
    else:
        stub.join()
    assert len(stub.settled) == 1


def test_a_poisonous_failure_is_not_reraised(events):
    @events.handler("orders.#")
    def poisoned(payload):
        with poisonous():
            raise ValueError("bad")

    stub = StubEvents(events)
    stub.publish("orders.1", {})
    stub.join()
    assert [s.action for s in stub.settled] == ["archive"]


def test_fails_fast_is_the_documented_rule(events):
    @events.handler("orders.#", dont_retry=(Declared,))
    def handler(payload):
        pass

    [resolved] = events.handlers
    assert not fails_fast(Retry(), resolved) and not fails_fast(Archive(), resolved)
    assert not fails_fast(Declared(), resolved)
    assert fails_fast(RuntimeError(), resolved) and fails_fast(KeyError(), resolved)


# -- publishing from the code under test ----------------------------------------------------------------


def test_the_apps_own_publish_goes_to_the_stub_while_it_stands_in(app, events):
    shipping = Events(app, "shipping")
    saved = events.publishing.publisher

    @events.handler("orders.*.created")
    def charge(payload):
        events.publish("billing.invoice.paid", {"order_id": payload["order_id"]}, headers={"tenant": "acme"})

    @shipping.handler("billing.invoice.*")
    def ship(payload):
        pass

    with StubEvents(events) as stub:
        message_ids = shipping.publish_many([("orders.1.created", {"order_id": 1}),
                                            ("orders.2.created", {"order_id": 2})])
        stub.join()
        with pytest.raises(UnroutableError):
            events.publish("nobody.listens", {})
    assert stub.calls(ship) == [{"order_id": 1}, {"order_id": 2}]
    assert [p.routing_key for p in stub.published] == [
        "orders.1.created", "orders.2.created", "billing.invoice.paid", "billing.invoice.paid", "nobody.listens"]
    assert [p.message_id for p in stub.published[:2]] == message_ids
    assert stub.published[2].headers == {"tenant": "acme"}
    assert events.publishing.publisher is saved and isinstance(shipping.publishing.publisher, Publisher)


def test_events_stub_fixture_is_a_factory_that_stands_in_for_the_test(events, events_stub):
    @events.handler("orders.#")
    def audit(payload):
        pass

    stub = events_stub(events)
    events.publish("orders.1", {"n": 1})
    stub.join()
    assert stub.calls(audit) == [{"n": 1}]


# -- middleware, signals, refusals ----------------------------------------------------------------------


class Recorder(Middleware):
    def __init__(self) -> None:
        self.seen: list[tuple] = []
        self.deferred: set = set()

    def received(self, delivery):
        self.seen.append(("received", delivery.queue, delivery.attempt))

    def before_dispatch(self, delivery):
        if delivery.headers.get("defer") and delivery.message_id not in self.deferred:
            self.deferred.add(delivery.message_id)
            return Outcome(DEFERRED, "paused", delay_ms=1000)
        return None

    def handling(self, event):
        self.seen.append(("handling", event.queue, event.attempt))
        return super().handling(event)

    def settled(self, delivery, outcome, step):
        self.seen.append(("settled", step.action, outcome.kind))


def test_middleware_hooks_are_called_as_the_worker_calls_them(app):
    recorder = Recorder()
    events = Events(app, "billing", middleware=[recorder], **FAST)

    @events.handler("orders.#", max_retries=0)
    def job(payload):
        if payload.get("fail"):
            raise ValueError("job failed")

    stub = StubEvents(events)
    stub.publish("orders.1", {})
    stub.publish("orders.2", {"fail": True})
    stub.publish("orders.3", {}, headers={"defer": True})
    stub.advance(5, fail_fast=False)
    assert recorder.seen == [
        ("received", "billing.job", 1), ("handling", "billing.job", 1), ("settled", "ack", "ok"),
        ("received", "billing.job", 1), ("handling", "billing.job", 1), ("settled", "archive", FAILED),
        ("received", "billing.job", 1), ("settled", "requeue", DEFERRED),
        ("received", "billing.job", 1), ("handling", "billing.job", 1), ("settled", "ack", "ok"),
    ]
    assert [(r.action, r.delay_ms, r.at) for r in stub.requeued] == [("requeue", 1000, 0.0)]


def test_message_settled_is_sent_for_every_delivery(events):
    @events.handler("orders.#")
    def audit(payload):
        pass

    seen = []

    def receiver(sender, action, queue, **kwargs):
        seen.append((sender, action, queue))

    signals.message_settled.connect(receiver, weak=False)
    try:
        stub = StubEvents(events)
        stub.publish("orders.1", {})
        stub.join()
    finally:
        signals.message_settled.disconnect(receiver)
    assert seen == [(audit, "ack", "billing.audit")]


def test_a_refused_retry_is_archived_and_a_refused_archive_is_retried_without_headers_then_held(events):
    @events.handler("orders.#")
    def fails(payload):
        raise RuntimeError("boom")

    refused: list[str] = []

    def refuse_retries(step: Republish) -> str | None:
        refused.append(step.action)
        return "nacked by the broker" if step.action == "retry" else None

    stub = StubEvents(events, refuse=refuse_retries)
    stub.publish("orders.1", {}, headers={"tenant": "acme"})
    stub.join(fail_fast=False)
    [archived] = stub.settled
    assert refused == ["retry", "archive"]
    assert archived.action == "archive" and archived.reason.startswith("retry publish failed (nacked by the broker)")
    assert archived.headers["tenant"] == "acme"

    stub = StubEvents(events, refuse=lambda step: "returned")
    stub.publish("orders.2", {})
    stub.join(fail_fast=False)
    [held] = stub.held
    assert held.reason.startswith("archive publish failed (returned); message left unacked")
    assert stub.pending == []


def test_a_message_sent_back_with_no_delay_forever_stops_the_join(app):
    class Forever(Middleware):
        def before_dispatch(self, delivery):
            return Outcome(DEFERRED, "again", delay_ms=0)

    events = Events(app, "billing", middleware=[Forever()], **FAST)

    @events.handler("orders.#")
    def never(payload):
        pass

    stub = StubEvents(events)
    stub.publish("orders.1", {})
    with pytest.raises(KombuEventsError, match="no delay"):
        stub.join()


@pytest.mark.parametrize("seconds", [-1, float("nan"), "1", True])
def test_advance_takes_seconds(events, seconds):
    @events.handler("orders.#")
    def audit(payload):
        pass

    with pytest.raises(ValueError, match="seconds >= 0"):
        StubEvents(events).advance(seconds)


def test_hold_records_keep_the_deliverys_headers(events):
    @events.handler("orders.#")
    def fails(payload):
        raise Archive("no")

    stub = StubEvents(events, refuse=lambda step: "no")
    stub.publish("orders.1", {"n": 1}, headers={"tenant": "acme"})
    stub.join()
    [held] = stub.held
    assert held.headers == {"tenant": "acme"} and held.payload == {"n": 1} and held.message_id


# -- every message ends once: acked or archived, after at most max_retries retries -------------------------

STEPS = st.sampled_from(["ok", "fail", "retry", "archive", "poison"])


def expected_settlements(script: list[str], max_retries: int) -> list[tuple[int, str, float]]:
    """(attempt, action, delay_ms) a message whose handler follows ``script`` must go through."""
    found = []
    for attempt in itertools.count(1):
        step = script[attempt - 1] if attempt <= len(script) else "ok"
        if step == "ok":
            return [*found, (attempt, "ack", 0)]
        if step in ("archive", "poison") or attempt > max_retries:
            return [*found, (attempt, "archive", 0)]
        found.append((attempt, "retry", 300 if step == "retry" else min(200 * 2 ** (attempt - 1), 1000)))
    raise AssertionError("unreachable")


@settings(max_examples=150, deadline=None)
@given(scripts=st.lists(st.lists(STEPS, max_size=6), min_size=1, max_size=4), max_retries=st.integers(0, 4))
def test_every_message_is_acked_or_archived_once_as_the_policy_says(scripts, max_retries):
    app = celery.Celery("proj", broker="memory://", set_as_current=False)
    events = Events(app, "billing", **FAST)

    @events.handler("orders.#", bind=True, max_retries=max_retries)
    def scripted(event):
        script = event.payload["script"]
        step = script[event.attempt - 1] if event.attempt <= len(script) else "ok"
        if step == "fail":
            raise RuntimeError("failed")
        if step == "retry":
            raise Retry(delay=0.3)
        if step == "archive":
            raise Archive("archived")
        if step == "poison":
            with poisonous():
                raise ValueError("poisoned")

    stub = StubEvents(events)
    ids = [stub.publish(f"orders.{n}", {"script": script}) for n, script in enumerate(scripts)]
    stub.advance(3600, fail_fast=False)
    assert stub.pending == []
    for message_id, script in zip(ids, scripts):
        settled = [(s.attempt, s.action, s.delay_ms) for s in stub.settled if s.message_id == message_id]
        assert settled == expected_settlements(script, max_retries)
        assert [e.attempt for e in stub.calls(scripted) if e.message_id == message_id] == [a for a, _, _ in settled]
