"""worker/screening.py: what the worker's consumer and the test stub both do before a handler runs and once settled."""
from __future__ import annotations

import logging

import pytest

from kombu_events import signals
from kombu_events.core.decision import DEFERRED, OK, REDELIVERED, UNDECODABLE, Outcome
from kombu_events.core.delivery import Delivery
from kombu_events.core.settlement import ACK, Hold
from kombu_events.middleware.base import Hooks, Middleware
from kombu_events.worker.screening import announce, screen

DELIVERY = Delivery("billing.audit", "orders.7.created", b"{}", {"message_id": "m-1"}, attempt=2)
DEFER = Outcome(DEFERRED, "circuit open", delay_ms=5000)


class Refuses(Middleware):
    def __init__(self) -> None:
        self.seen: list[Delivery] = []

    def before_dispatch(self, delivery):
        self.seen.append(delivery)
        return DEFER


def test_a_readable_first_delivery_runs_its_handler():
    assert screen(DELIVERY, Hooks()) is None


def test_an_unreadable_delivery_is_undecodable_and_middleware_never_sees_it():
    refuses = Refuses()
    outcome = screen(DELIVERY._replace(unreadable="header 'x-death' is odd", redelivered=True), Hooks([refuses]))
    assert outcome == Outcome(UNDECODABLE, "header 'x-death' is odd")
    assert refuses.seen == []


def test_a_redelivery_goes_back_counted_before_middleware_is_asked():
    refuses = Refuses()
    outcome = screen(DELIVERY._replace(redelivered=True), Hooks([refuses]))
    assert outcome is not None and outcome.kind == REDELIVERED
    assert refuses.seen == []


def test_middleware_may_refuse_a_delivery():
    refuses = Refuses()
    assert screen(DELIVERY, Hooks([refuses])) is DEFER
    assert refuses.seen == [DELIVERY]


class Settles(Middleware):
    def __init__(self) -> None:
        self.seen: list[tuple] = []

    def settled(self, delivery, outcome, step):
        self.seen.append((delivery, outcome, step))


@pytest.fixture
def settled_signals():
    seen: list[tuple] = []

    def receiver(sender, **arguments):
        seen.append((sender, arguments))

    signals.message_settled.connect(receiver, weak=False)
    yield seen
    signals.message_settled.disconnect(receiver)


def test_announce_logs_signals_and_calls_the_settled_hooks(settled_signals, caplog):
    settles, outcome, step = Settles(), Outcome(OK, duration_ms=1.5), Hold("refused twice")

    def handler(payload):
        return None

    with caplog.at_level(logging.INFO, logger="kombu_events.outcome"):
        announce(handler, Hooks([settles]), DELIVERY, outcome, step)
    assert settles.seen == [(DELIVERY, outcome, step)]
    [(sender, arguments)] = settled_signals
    assert sender is handler
    assert arguments["action"] == "held" and arguments["reason"] == "refused twice"
    assert (arguments["queue"], arguments["routing_key"], arguments["message_id"], arguments["attempt"]) == (
        "billing.audit", "orders.7.created", "m-1", 2)
    assert arguments["outcome"] is outcome and arguments["handler_duration_ms"] == 1.5
    [record] = caplog.records
    assert record.kombu_events["outcome"] == "held" and record.kombu_events["attempt"] == 2


def test_announce_without_receivers_or_hooks_only_logs(caplog):
    with caplog.at_level(logging.INFO, logger="kombu_events.outcome"):
        announce(print, Hooks(), DELIVERY, Outcome(OK), ACK)
    assert [r.kombu_events["outcome"] for r in caplog.records] == ["ack"]
