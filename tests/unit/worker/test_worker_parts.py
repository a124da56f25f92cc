"""The consumer's parts, each alone: the Settler carries out a step, the Throttle stops and starts the consumers,
the Handoff takes messages to a pool and back. No consumer, no connection: fakes of what each one calls."""
from __future__ import annotations

import contextlib
import json
from types import SimpleNamespace
from typing import Any

import pytest

from kombu_events.core import decision
from kombu_events.core.delivery import read_delivery
from kombu_events.core.settlement import ACK, Hold, Republish, Rerun
from kombu_events.worker import runner
from kombu_events.worker.handoff import Handoff, Received
from kombu_events.worker.inflight import InflightBudget
from kombu_events.worker.mailbox import Mailbox
from kombu_events.worker.settling import Settler
from kombu_events.worker.throttle import Throttle

from .fakes import Pool, Settles

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


class Wakes:
    """A hub's timers: (delay, callback, cancelled) of each ``call_later``."""

    def __init__(self) -> None:
        self.set: list[list[Any]] = []

    def call_later(self, delay: float, fn: Any) -> Any:
        entry = [delay, fn, False]
        self.set.append(entry)
        return SimpleNamespace(cancel=lambda: entry.__setitem__(2, True))

    def live(self) -> list[list[Any]]:
        return [entry for entry in self.set if not entry[2]]

    def fire(self) -> None:
        """The hub fires the first timer set (and forgets it)."""
        entry = self.live()[0]
        entry[2] = True
        entry[1]()


def test_a_rerun_goes_to_the_pool_when_due_with_the_steps_counters_on_its_connection_only():
    deliveries: list[Any] = []

    class Keeps(Settles):
        def settle(self, route, delivery, message, result) -> None:
            deliveries.append(delivery)

    settles, pool, hub, now = Keeps(), Pool(), Wakes(), [100.0]
    handoff = Handoff("svc", awaited=frozenset(), async_concurrency=10, mailbox=Mailbox("svc"), settler=settles)
    handoff.attach(None, pool, hub, in_flight=10)
    handoff.clock = lambda: now[0]
    first = delivery(i=1)._replace(attempt=3, redeliveries=1, redelivered=True)
    handoff.rerun(route(), delivery(i=2), Message(), Rerun(500, "boom", attempt=2, redeliveries=0))
    handoff.rerun(route(), first, Message(), Rerun(250, "redelivered", attempt=3, redeliveries=2))
    assert [entry[0] for entry in hub.live()] == [0.25], "one timer, for the soonest"
    now[0] += 0.25
    hub.fire()
    (fn, args, done, _), = pool.jobs
    assert fn is runner.run and args[4][1] == 3, "a requeue in place spends no attempt"
    done(OK)
    assert [(d.message_id, d.attempt, d.redeliveries) for d in deliveries] == [("m1", 3, 2)]
    assert [entry[0] for entry in hub.live()] == [0.25], "then one for the next"
    handoff.attach(None, pool, hub, in_flight=10)  # reconnected: the broker redelivers the other one
    assert hub.live() == [] and handoff.reruns == []
    now[0] += 1
    handoff.tick()
    assert len(pool.jobs) == 1


def test_every_rerun_due_goes_at_once_however_many():
    settles, pool, hub, now = Settles(), Pool(), Wakes(), [0.0]
    handoff = Handoff("svc", awaited=frozenset(), async_concurrency=10, mailbox=Mailbox("svc"), settler=settles)
    handoff.attach(None, pool, hub, in_flight=100)
    handoff.clock = lambda: now[0]
    for i in range(50):
        handoff.rerun(route(), delivery(i=i), Message(), Rerun(10 + i % 3, "boom", attempt=2))
    now[0] += 0.5
    handoff.tick()  # the loop turned: all 50 are due, not only the 10 a hub fires a turn
    assert sorted(json.loads(args[1])["i"] for _, args, _, _ in pool.jobs) == list(range(50))
    assert handoff.reruns == []


def test_a_rerun_waits_for_room_within_its_handlers_concurrency():
    settles, pool, hub, now = Settles(), Pool(), Wakes(), [0.0]
    handoff = limited(1, pool, settles)
    handoff.attach(None, pool, hub, in_flight=100)
    handoff.clock = lambda: now[0]
    handoff.add(received(0))
    handoff.rerun(route(), delivery(i=1), Message(), Rerun(10, "boom", attempt=2))
    now[0] += 1
    handoff.tick()
    assert ids(pool) == [0], "the handler runs one at a time: the rerun waits"
    pool.jobs[0][2](OK)
    assert ids(pool) == [0, 1]


def test_the_results_of_a_batch_are_settled_with_their_acks_together():
    inside: list[bool] = []

    class Together:
        depth = 0

        @contextlib.contextmanager
        def together(self):
            self.depth += 1
            yield
            self.depth -= 1

    class Keeps(Settles):
        acks = Together()

        def settle(self, route, delivery, message, result) -> None:
            inside.append(self.acks.depth == 1)

    settles, pool = Keeps(), Pool()
    pool.limit = 2
    handoff = Handoff("svc", awaited=frozenset(), async_concurrency=10, mailbox=Mailbox("svc"), settler=settles)
    handoff.attach(None, pool, SimpleNamespace(call_later=lambda delay, fn: None), in_flight=10)
    handoff.more_to_read = lambda: True
    handoff.batch.observe("svc.handle", 0.01)
    for i in range(3):
        handoff.add(received(i))
    handoff.flush()
    pool.jobs[0][2](runner.Outcomes([OK] * 3))
    assert inside == [True] * 3


# -- a handler's concurrency -------------------------------------------------------------------------------


def limited(limit: int, pool: Pool, settles: Settles, hub: Any = None) -> Handoff:
    handoff = Handoff("svc", awaited=frozenset(), async_concurrency=10, mailbox=Mailbox("svc"), settler=settles,
                      limits={"svc.handle": limit})
    handoff.attach(None, pool, hub, in_flight=100)
    return handoff


def ids(pool: Pool) -> list[int]:
    """The events of each job, in order (one job: one event, or the list of a batch)."""
    return [json.loads(args[1])["i"] if fn is runner.run else [json.loads(item[1])["i"] for item in args[0]]
            for fn, args, _, _ in pool.jobs]


def test_at_most_concurrency_messages_of_a_handler_are_in_the_pool_the_next_goes_when_one_ends():
    settles, pool = Settles(), Pool()
    handoff = limited(2, pool, settles)
    for i in range(5):
        handoff.add(received(i))
    assert ids(pool) == [0, 1] and handoff.running == {"svc.handle": 2}
    assert [r.delivery.message_id for r in handoff.waiting["svc.handle"]] == ["m2", "m3", "m4"]
    pool.jobs[1][2](OK)  # the second ends: the third goes, in order
    assert ids(pool) == [0, 1, 2] and handoff.running == {"svc.handle": 2}
    pool.jobs[0][3](SimpleNamespace(exception=RuntimeError("lost"), traceback=""))  # a lost one ends too
    pool.jobs[2][2](OK)
    assert ids(pool) == [0, 1, 2, 3, 4] and not handoff.waiting["svc.handle"]
    for job in pool.jobs[3:]:
        job[2](OK)
    assert handoff.running == {"svc.handle": 0} and len(settles.settled) == 5


def test_a_batch_takes_only_the_room_a_limited_handler_has_and_other_handlers_are_not_held(monkeypatch):
    settles, pool = Settles(), Pool()
    pool.limit = 4
    hub = SimpleNamespace(call_later=lambda delay, fn: None)
    handoff = limited(2, pool, settles, hub)
    handoff.more_to_read = lambda: True  # the read goes on: everything waits for the batch
    handoff.batch.observe("svc.handle", 0.01)
    handoff.batch.observe("svc.other", 0.01)
    for i in range(4):
        handoff.add(received(i))
        other = received(10 + i)
        handoff.add(other._replace(route=route("svc.other")))
    handoff.flush()
    assert ids(pool) == [[0, 10, 1, 11, 12, 13]], "two of the limited handler; all of the other"
    pool.jobs[0][2](runner.Outcomes([OK] * 6))
    assert ids(pool)[1:] == [2, 3] and handoff.running == {"svc.handle": 2}


def test_a_message_the_pool_refuses_frees_its_place_for_the_next_one():
    class Refusing(Pool):
        def apply_async(self, fn, args, callback, error_callback):
            if json.loads(args[1])["i"] == 0:
                raise RecursionError("too deep to pickle")
            super().apply_async(fn, args, callback, error_callback)

    settles, pool = Settles(), Refusing()
    handoff = limited(1, pool, settles)
    for i in range(3):
        handoff.add(received(i))
    assert ids(pool) == [1] and handoff.running == {"svc.handle": 1}
    assert [m for m, outcome in settles.settled] == ["m0"]


def test_under_solo_each_end_hands_over_the_next_without_recursing_for_each():
    class Solo(Pool):
        def apply_async(self, fn, args, callback, error_callback):
            super().apply_async(fn, args, callback, error_callback)
            callback(OK)  # solo runs the job inside apply_async

    settles, pool = Settles(), Solo()
    handoff = limited(1, pool, settles)
    handoff.more_to_read = lambda: True
    handoff.batch.observe("svc.handle", 0.01)
    handoff.batch.max_messages = 3000
    for i in range(2000):
        handoff.batch.add("svc.handle", received(i))
    handoff.flush()  # deeper than the recursion limit if each end recursed into the next hand-over
    assert len(pool.jobs) == 2000 and handoff.running == {"svc.handle": 0}


def test_jobs_of_a_connection_gone_do_not_free_places_on_the_new_one():
    settles, pool = Settles(), Pool()
    handoff = limited(1, pool, settles)
    handoff.add(received(1))
    handoff.add(received(2))  # waits
    handoff.attach(None, pool, None, in_flight=100)  # reconnected: what waited is redelivered by the broker
    assert handoff.waiting == {} and handoff.running == {}
    handoff.add(received(3))
    handoff.add(received(4))
    pool.jobs[0][2](OK)  # the old connection's job ends
    assert ids(pool) == [1, 3], "message 4 still waits for message 3"


@pytest.mark.parametrize("bad", [0, -1, 10_001, 2.0, True, "4"])
def test_a_concurrency_that_is_no_count_is_refused_at_registration(bad):
    from celery import Celery

    from kombu_events import ConfigurationError, Events

    events = Events(Celery("t", broker="memory://"), service="limits")
    with pytest.raises(ConfigurationError, match=r"concurrency must be an integer within 1 \.\. 10000"):
        events.handler("orders.#", concurrency=bad)


def test_a_handlers_concurrency_reaches_the_worker_hand_off():
    from celery import Celery

    from kombu_events import Events, registry
    from kombu_events.worker.consumer import ServiceConsumer

    registry.reset()
    try:
        app = Celery("t", broker="memory://")
        events = Events(app, service="limits")

        @events.handler("orders.#", concurrency=3)
        def orders(payload):
            pass

        @events.handler("audit.#")
        def audit(payload):
            pass

        registry.resolve(app)
        assert ServiceConsumer(events).handoff.limits == {"limits.orders": 3}
    finally:
        registry.reset()
