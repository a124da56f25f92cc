"""The consumer's parts, each alone: the Settler carries out a step, the Throttle stops and starts the consumers,
the Handoff takes messages to a pool and back. No consumer, no connection: fakes of what each one calls."""
from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import pytest

from kombu_events.core import decision
from kombu_events.core.delivery import read_delivery
from kombu_events.core.settlement import ACK, Hold, Republish
from kombu_events.worker import runner
from kombu_events.worker.handoff import Handoff, Received
from kombu_events.worker.inflight import InflightBudget
from kombu_events.worker.mailbox import Mailbox
from kombu_events.worker.settling import Settler
from kombu_events.worker.throttle import Throttle

OK = decision.Outcome(decision.OK, duration_ms=0.5)
FAILED = decision.Outcome(decision.FAILED, "boom", "RuntimeError: boom")


class Message:
    def __init__(self, body: bytes = b'{"i": 1}') -> None:
        self.body = body
        self.acks = 0

    def ack(self) -> None:
        self.acks += 1


class Confirmer:
    """Keeps each publish's callbacks: the test plays the broker's answer."""

    def __init__(self) -> None:
        self.published: list[tuple[Any, ...]] = []
        self.refused: str | None = None

    def publish(self, message, exchange, routing_key, on_ok, on_fail) -> None:
        self.published.append((message, exchange, routing_key, on_ok, on_fail))


def route(queue: str = "svc.handle", max_retries: int = 3) -> Any:
    return SimpleNamespace(handler=SimpleNamespace(queue=queue, max_retries=max_retries, backoff=None,
                                                   fn=lambda payload: None))


def delivery(queue: str = "svc.handle", i: int = 1) -> Any:
    return read_delivery(queue, json.dumps({"i": i}).encode(),
                         {"message_id": f"m{i}", "content_type": "application/json"},
                         {"routing_key": "orders.created", "redelivered": False}, received=0.0)


@pytest.fixture
def settler(monkeypatch):
    released: list[Any] = []
    announced: list[tuple[str, str]] = []
    paused: list[tuple[str, str]] = []
    control = SimpleNamespace(pause=lambda queue, reason="": paused.append((queue, reason)))
    settler = Settler(topology=None, hooks=None, control=control, traceback_limit=10,  # type: ignore[arg-type]
                      release=released.append)
    monkeypatch.setattr(settler, "announce", lambda route, delivery, outcome, step:
                        announced.append((delivery.message_id, step.action)))
    settler.released, settler.announced, settler.paused = released, announced, paused
    return settler


def republish(action: str = "retry", fallback: Any = None) -> Republish:
    return Republish(action, "svc.retry", "svc.handle", {"headers": {}},
                     if_refused=fallback or (lambda why: Hold(f"gave up: {why}")))


def test_an_ack_acks_releases_and_announces(settler):
    message = Message()
    settler.execute(route(), delivery(), message, OK, ACK)
    assert (message.acks, settler.released, settler.announced) == (1, [message], [("m1", "ack")])


def test_a_republish_acks_the_original_only_once_the_broker_confirms_the_copy(settler):
    settler.confirmer = Confirmer()
    message = Message()
    settler.execute(route(), delivery(), message, FAILED, republish())
    ((copy, exchange, routing_key, on_ok, _),) = settler.confirmer.published
    assert (copy.body, exchange, routing_key) == (message.body, "svc.retry", "svc.handle")
    assert message.acks == 0 and settler.released == [], "held until confirmed"
    on_ok()
    assert message.acks == 1 and settler.announced == [("m1", "retry")]


def test_a_republish_without_a_channel_leaves_the_original_to_be_redelivered(settler):
    message = Message()
    settler.execute(route(), delivery(), message, FAILED, republish())
    assert (message.acks, settler.released, settler.announced) == (0, [message], [])


def test_a_copy_the_broker_returns_takes_the_steps_fallback(settler):
    settler.confirmer = Confirmer()
    message = Message()
    archive = republish("archive")
    settler.execute(route(), delivery(), message, FAILED, republish(fallback=lambda why: archive))
    settler.confirmer.published[0][4]("returned NO_ROUTE")
    on_ok = settler.confirmer.published[1][3]
    on_ok()
    assert message.acks == 1 and settler.announced == [("m1", "archive")]


def test_a_copy_refused_for_a_missing_permission_pauses_the_queue_and_holds_the_original(settler):
    settler.confirmer = Confirmer()
    message = Message()
    settler.execute(route(), delivery(), message, FAILED, republish())
    settler.confirmer.refused = "ACCESS_REFUSED - write access to exchange 'svc.retry'"
    settler.confirmer.published[0][4]("channel closed")
    assert len(settler.confirmer.published) == 1, "no fallback: the archive would be refused the same"
    assert settler.paused == [("svc.handle", "retry refused: ACCESS_REFUSED - write access to exchange 'svc.retry'")]
    assert (message.acks, settler.released, settler.announced) == (0, [message], [("m1", "held")])


def test_settle_never_raises_a_plan_that_fails_leaves_the_message_unacked(settler, caplog):
    message = Message()
    settler.settle(route(), delivery(), message, OK)  # topology None: planning fails inside
    assert message.acks == 0 and settler.released == [message]
    assert "could not settle message 'm1'" in caplog.text


# -- the Throttle ---------------------------------------------------------------------------------------


def test_the_throttle_stops_when_the_budget_is_spent_and_starts_once_it_has_room():
    calls: list[str] = []
    budget = InflightBudget(max_bytes=100, body_bytes=40, consumers=1)
    throttle = Throttle(budget, Mailbox("svc"), service="svc", stop=lambda: calls.append("stop"),
                        start=lambda: calls.append("start"), running=lambda: True)
    big, small = Message(b"x" * 90), Message(b"y" * 20)
    throttle.take(big)
    assert calls == [] and not throttle.throttled
    throttle.take(small)  # 110 > 100
    assert calls == ["stop"] and throttle.throttled
    throttle.release(small)  # 90 held: room for 10, less than one body of 40
    throttle.release(small)  # twice: counted once
    assert calls == ["stop"] and (budget.in_flight, budget.in_flight_bytes) == (1, 90)
    throttle.release(big)
    assert calls == ["stop", "start"] and (budget.in_flight, budget.in_flight_bytes) == (0, 0)


def test_a_throttle_not_running_counts_but_neither_stops_nor_starts():
    calls: list[str] = []
    budget = InflightBudget(max_bytes=10, body_bytes=10)
    throttle = Throttle(budget, Mailbox("svc"), service="svc", stop=lambda: calls.append("stop"),
                        start=lambda: calls.append("start"), running=lambda: False)
    throttle.take(Message(b"z" * 50))
    throttle.take(Message(b"z" * 50))
    assert calls == [] and budget.in_flight == 2


# -- the Handoff ----------------------------------------------------------------------------------------


class Pool:
    limit = 1

    def __init__(self) -> None:
        self.jobs: list[tuple[Any, ...]] = []

    def apply_async(self, fn, args, callback, error_callback):
        self.jobs.append((fn, args, callback, error_callback))


class Settles:
    def __init__(self) -> None:
        self.settled: list[tuple[str, Any]] = []
        self.held: list[tuple[str, str]] = []

    def settle(self, route, delivery, message, result) -> None:
        self.settled.append((delivery.message_id, result))

    def hold(self, route, delivery, message, outcome, step) -> None:
        self.held.append((delivery.message_id, step.reason))


def received(i: int) -> Received:
    d = delivery(i=i)
    item: runner.Item = ("svc.handle", d.body, d.content_type, d.content_encoding, (), False)
    return Received(route(), d, Message(d.body), item)


def test_a_handoff_alone_sends_each_message_to_the_pool_and_its_result_to_the_settler():
    settles, pool = Settles(), Pool()
    handoff = Handoff("svc", awaited=frozenset(), async_concurrency=10, mailbox=Mailbox("svc"), settler=settles)
    handoff.attach(None, pool, None, in_flight=10)  # no event loop: one message per job
    handoff.add(received(1))
    handoff.add(received(2))
    assert [args[1] for _, args, _, _ in pool.jobs] == [b'{"i": 1}', b'{"i": 2}'] and handoff.jobs == 2
    pool.jobs[1][2](OK)
    pool.jobs[0][3](SimpleNamespace(exception=RuntimeError("lost"), traceback=""))
    assert [m for m, _ in settles.settled] == ["m2", "m1"] and handoff.jobs == 0


def test_a_handoff_counts_only_the_jobs_of_its_current_connection():
    settles, pool = Settles(), Pool()
    handoff = Handoff("svc", awaited=frozenset(), async_concurrency=10, mailbox=Mailbox("svc"), settler=settles)
    handoff.attach(None, pool, None, in_flight=10)
    handoff.add(received(1))
    handoff.attach(None, pool, None, in_flight=10)  # reconnected: the old job is not counted any more
    handoff.add(received(2))
    pool.jobs[0][2](OK)  # the old connection's job, back late
    assert handoff.jobs == 1 and [m for m, _ in settles.settled] == ["m1"]
