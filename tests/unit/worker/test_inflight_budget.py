"""The budget of body bytes in flight (``inflight_max_bytes``): the pure InflightBudget, then the consumer acting
on it against a model of RabbitMQ's dispatch (a message counts as unacknowledged once sent, as many as a
consumer's prefetch allows, whatever its size)."""
from __future__ import annotations

import collections
import functools
import itertools
from typing import Any

import pytest
from celery import Celery
from hypothesis import given, settings, strategies as st
from kombu.transport.base import StdChannel

from kombu_events import Events, registry
from kombu_events.core import decision
from kombu_events.core.config import resolve_settings
from kombu_events.errors import ConfigurationError
from kombu_events.worker import consumer as consumer_module
from kombu_events.worker.consumer import ServiceConsumer
from kombu_events.worker.inflight import InflightBudget

KIB = 1024

# -- InflightBudget (pure) --------------------------------------------------------------------------------

ops = st.lists(st.one_of(st.tuples(st.just("take"), st.integers(0, 10_000)),
                         st.tuples(st.just("settle"), st.integers(0, 50))), max_size=60)


@settings(max_examples=300, deadline=None)
@given(max_bytes=st.integers(0, 20_000), body_bytes=st.integers(1, 5_000), consumers=st.integers(1, 20),
       steps=ops, wanted=st.integers(1, 500))
def test_the_budget_counts_what_is_held_pauses_when_over_and_resumes_with_room_for_every_consumer(
        max_bytes, body_bytes, consumers, steps, wanted):
    budget = InflightBudget(max_bytes=max_bytes, body_bytes=body_bytes, consumers=consumers)
    held: list[int] = []
    paused = False  # the model
    for op, value in steps:
        if op == "take":
            budget.take(value)
            held.append(value)
        elif held:
            budget.settle(held.pop(value % len(held)))
        room = max_bytes - sum(held)
        if not (max_bytes and held):
            paused = False
        elif room < 0:
            paused = True
        elif room >= body_bytes * consumers:
            paused = False
        assert (budget.in_flight, budget.in_flight_bytes) == (len(held), sum(held)), "never negative, never lost"
        assert budget.paused == paused
        if sum(held) > max_bytes and held and max_bytes:
            assert budget.paused, "over the budget with something held: paused"
        prefetch = budget.prefetch(wanted)
        assert 1 <= prefetch <= wanted
        if max_bytes and prefetch > 1:  # more than one only when bodies of body_bytes fit the room left
            assert prefetch * body_bytes * consumers <= room
        if not max_bytes:
            assert prefetch == wanted
    for size in list(held):
        budget.settle(size)
    assert (budget.in_flight, budget.in_flight_bytes, budget.paused) == (0, 0, False)


@given(size=st.integers(1, 10**9), max_bytes=st.integers(1, 10**6), consumers=st.integers(1, 5))
def test_one_body_larger_than_the_whole_budget_is_admitted_alone(size, max_bytes, consumers):
    budget = InflightBudget(max_bytes=max_bytes, body_bytes=max_bytes, consumers=consumers)
    assert not budget.paused and budget.prefetch(100) == 1, "nothing held: it may come"
    budget.take(size)
    assert budget.paused == (size > max_bytes), "then nothing else comes while it is held"
    budget.settle(size)
    assert not budget.paused


@given(st.lists(st.integers(-5, 100), max_size=20))
def test_settling_more_than_was_taken_never_goes_negative(sizes):
    budget = InflightBudget(max_bytes=10, body_bytes=1)
    budget.take(3)
    for size in sizes:
        budget.settle(size)
        assert budget.in_flight >= 0 and budget.in_flight_bytes >= 0


@pytest.mark.parametrize("consumers, expected", [(1, 8), (2, 4), (5, 1), (9, 1)])
def test_the_prefetch_is_what_bodies_of_max_body_bytes_leave_room_for(consumers, expected):
    budget = InflightBudget(max_bytes=128 * KIB, body_bytes=16 * KIB, consumers=consumers)
    assert budget.prefetch(100) == expected
    budget.take(100 * KIB)
    assert budget.prefetch(100) == 1
    assert InflightBudget(max_bytes=0, body_bytes=1, consumers=consumers).prefetch(100) == 100


# -- the setting --------------------------------------------------------------------------------------------


def test_the_setting_defaults_to_128_mib_and_reads_celery_conf_and_keyword():
    assert resolve_settings("svc", environ={}).inflight_max_bytes == 256 * 1024 * 1024
    assert resolve_settings("svc", {"kombu_events_inflight_max_bytes": 0}, environ={}).inflight_max_bytes == 0
    assert resolve_settings("svc", {"kombu_events_inflight_max_bytes": 5}, environ={},
                            inflight_max_bytes=7).inflight_max_bytes == 7


@pytest.mark.parametrize("value", [-1, 2**40 + 1, 1.5, "1", True])
def test_a_bad_budget_names_the_setting_and_the_range(value):
    with pytest.raises(ConfigurationError, match=r"inflight_max_bytes must be an integer within 0 \.\. "):
        resolve_settings("svc", environ={}, inflight_max_bytes=value)


# -- the consumer against a model of RabbitMQ's dispatch ----------------------------------------------------


class Broker:
    """Queues, consumers with their prefetch, and the frames sent to the worker and not read yet."""

    def __init__(self) -> None:
        self.queues: dict[str, collections.deque] = collections.defaultdict(collections.deque)
        self.consumers: dict[str, dict[str, Any]] = {}  # tag -> queue, callback, prefetch, unacked tags, channel
        self.unacked: dict[int, tuple[str, Any, Any]] = {}  # delivery tag -> (queue, raw, channel)
        self.wire: collections.deque = collections.deque()  # (consumer tag, raw) sent, not read yet
        self.tags = itertools.count(1)
        self.most_unacked = 0
        self.unacked_per_queue_seen: dict[str, int] = collections.Counter()

    def publish(self, queue: str, message_id: str, size: int) -> None:
        self.queues[queue].append(Raw(b"x" * size, {"message_id": message_id, "content_type": "text/plain"}))

    def pump(self) -> None:
        """Send what each consumer's prefetch allows (RabbitMQ: unacknowledged from then on)."""
        for tag, sub in list(self.consumers.items()):
            queue = self.queues[sub["queue"]]
            while queue and len(sub["unacked"]) < sub["prefetch"]:
                raw = queue.popleft()
                delivery_tag = next(self.tags)
                raw.delivery_info = {"routing_key": "orders.created", "exchange": "events",
                                     "delivery_tag": delivery_tag, "redelivered": raw.redelivered}
                sub["unacked"].add(delivery_tag)
                self.unacked[delivery_tag] = (sub["queue"], raw, sub["channel"])
                self.wire.append((tag, raw))
        self.most_unacked = max(self.most_unacked, len(self.unacked))

    def read_one(self) -> bool:
        """The worker reads one delivery off the socket; whether there was one."""
        if not self.wire:
            return False
        tag, raw = self.wire.popleft()
        channel = self.unacked[raw.delivery_info["delivery_tag"]][2]
        callback = channel.callbacks.get(tag)
        assert callback is not None, "py-amqp calls back a consumer until its CancelOk, RabbitMQ sends none after"
        callback(raw)
        return True

    def ack(self, delivery_tag: int) -> None:
        assert delivery_tag in self.unacked, f"unknown delivery tag {delivery_tag}: a double ack"
        del self.unacked[delivery_tag]
        for sub in self.consumers.values():
            sub["unacked"].discard(delivery_tag)
        self.pump()

    def close(self, channel: Channel) -> None:
        """A closed channel's consumers go; its unacknowledged messages go back to the head of their queues."""
        for tag in [t for t, sub in self.consumers.items() if sub["channel"] is channel]:
            del self.consumers[tag]
        self.wire = collections.deque((t, raw) for t, raw in self.wire
                                      if self.unacked[raw.delivery_info["delivery_tag"]][2] is not channel)
        back = sorted((t, q, raw) for t, (q, raw, ch) in self.unacked.items() if ch is channel)
        for delivery_tag, queue, raw in reversed(back):
            del self.unacked[delivery_tag]
            self.queues[queue].appendleft(Raw(raw.body, raw.properties, redelivered=True))
        self.pump()


class Raw:
    def __init__(self, body: bytes, properties: dict[str, Any], redelivered: bool = False) -> None:
        self.body, self.properties, self.redelivered = body, properties, redelivered
        self.delivery_info: dict[str, Any] = {}


class Message:
    """kombu's message, as far as the consumer uses it."""

    accept: Any = None

    def __init__(self, raw: Raw, broker: Broker) -> None:
        self.errors: list[Any] = []
        self.body, self.properties, self.delivery_info = raw.body, raw.properties, raw.delivery_info
        self.delivery_tag = raw.delivery_info["delivery_tag"]
        self._broker = broker

    def ack(self) -> None:
        self._broker.ack(self.delivery_tag)


class Channel(StdChannel):
    """A channel of the worker's connection: a synchronous method reads every frame waiting first."""

    is_open = True
    channel_id = 1

    def __init__(self, broker: Broker, connection: Connection) -> None:
        self.broker, self.connection = broker, connection
        self.events: dict[str, set[Any]] = collections.defaultdict(set)
        self.callbacks: dict[str, Any] = {}
        self.auto_decode = True
        self.message_to_python: Any = None
        self.qos = 0
        self.published: list[tuple[str, str, Any]] = []

    def Message(self, raw: Raw, channel: Any = None) -> Message:  # kombu's name for it
        return Message(raw, self.broker)

    def _read_waiting(self) -> None:
        while self.broker.read_one():
            pass

    def basic_qos(self, prefetch_size: int, prefetch_count: int, a_global: bool) -> None:
        assert not a_global, "per-consumer prefetch only (RabbitMQ 4.3 refuses global QoS)"
        self._read_waiting()
        self.qos = prefetch_count

    def basic_consume(self, queue: str = "", consumer_tag: str = "", no_ack: bool = False, callback: Any = None,
                      nowait: bool = False, **kwargs: Any) -> str:
        assert not no_ack and self.qos > 0
        self.callbacks[consumer_tag] = callback
        self.broker.consumers[consumer_tag] = {"queue": queue, "prefetch": self.qos, "unacked": set(),
                                               "channel": self}
        if not nowait:
            self._read_waiting()
        self.broker.pump()
        return consumer_tag

    def basic_cancel(self, consumer_tag: str, nowait: bool = False) -> None:
        self.broker.consumers.pop(consumer_tag, None)  # its unacknowledged messages stay so
        self._read_waiting()  # what was sent before the CancelOk still reaches the callback
        self.callbacks.pop(consumer_tag, None)

    def confirm_select(self) -> None:
        pass

    def send_method(self, method: Any, signature: str, args: tuple, content: Any = None, **kwargs: Any) -> None:
        self.published.append((args[1], args[2], content.properties.get("message_id")))
        self.connection.to_confirm.append(self)

    def confirm_next(self) -> bool:
        for callback in list(self.events["basic_ack"]):
            callback(len(self.published), False)
        return True

    def close(self) -> None:
        self.is_open = False
        self.broker.close(self)


class Connection:
    userid = "guest"
    frame_max = 131072

    def __init__(self, broker: Broker) -> None:
        self.broker = broker
        self.to_confirm: list[Channel] = []

    def channel(self) -> Channel:
        return Channel(self.broker, self)


class Pool:
    """solo: a job runs inside apply_async. Otherwise jobs wait until the test lets the oldest finish."""

    is_green = False

    def __init__(self, *, solo: bool, limit: int = 1) -> None:
        self.solo, self.limit = solo, limit
        self.handled: list[tuple[str, str]] = []
        self.waiting: list[tuple[tuple, Any]] = []

    def apply_async(self, fn: Any, args: tuple, callback: Any, error_callback: Any) -> None:
        if self.solo:
            self._run(args, callback)
        else:
            self.waiting.append((args, callback))

    def finish_oldest(self) -> bool:
        if not self.waiting:
            return False
        args, callback = self.waiting.pop(0)
        self._run(args, callback)
        return True

    def _run(self, args: tuple, callback: Any) -> None:
        self.handled.append((args[0], args[4][3]["message_id"]))
        callback(decision.Outcome(decision.OK, duration_ms=1.0))


class Loop:
    """Celery's loop without a hub: what ``call_soon`` got runs between two reads of the connection."""

    def __init__(self) -> None:
        self.pending: list[Any] = []

    def call_soon(self, fn: Any, *args: Any) -> None:
        self.pending.append(functools.partial(fn, *args))

    def turn(self) -> bool:
        ran = bool(self.pending)
        while self.pending:
            self.pending.pop(0)()
        return ran


QUEUES = ("budget.one", "budget.two", "budget.three")


@pytest.fixture
def make_consumer(monkeypatch):
    monkeypatch.setattr(consumer_module, "declare", lambda topology, connection: None)  # no broker here
    registry.reset()

    def make(queues: int = 1, **settings: Any) -> ServiceConsumer:
        app = Celery("t", broker="memory://")
        events = Events(app, service="budget", **settings)
        for queue in QUEUES[:queues]:
            events.handler("orders.#", queue=queue, name=queue)(lambda payload: None)
        registry.resolve(app)
        return ServiceConsumer(events)

    yield make
    registry.reset()


def run(consumer: ServiceConsumer, broker: Broker, pool: Pool, loop: Loop, connection: Connection,
        *, steps: int = 10_000) -> None:
    """Turn the loop until nothing more happens: read a delivery, run what was posted, finish a job, confirm."""
    for _ in range(steps):
        progressed = broker.read_one()
        progressed = loop.turn() or progressed
        progressed = pool.finish_oldest() or progressed
        if connection.to_confirm:
            connection.to_confirm.pop(0).confirm_next()
            progressed = True
        if not progressed:
            return
    raise AssertionError(f"still busy after {steps} steps")


def started(consumer: ServiceConsumer, broker: Broker, pool: Pool) -> tuple[Loop, Connection]:
    loop, connection = Loop(), Connection(broker)
    consumer.start(connection, pool, None, call_soon=loop.call_soon)  # no hub: start() consumes
    return loop, connection


@pytest.mark.parametrize("solo", [True, False])
def test_twelve_bodies_of_15_units_with_a_budget_of_48_are_handled_once_in_order_never_more_than_3_sent(
        make_consumer, solo):
    consumer = make_consumer(max_body_bytes=16 * KIB, inflight_max_bytes=48 * KIB)
    broker, pool = Broker(), Pool(solo=solo, limit=2)
    for i in range(12):
        broker.publish("budget.one", f"m{i}", 15 * KIB)
    loop, connection = started(consumer, broker, pool)
    run(consumer, broker, pool, loop, connection)
    assert pool.handled == [("budget.one", f"m{i}") for i in range(12)]
    assert broker.most_unacked == 3, "prefetch 48 // 16: the budget holds three bodies of max_body_bytes"
    assert not broker.unacked and (consumer.budget.in_flight, consumer.budget.in_flight_bytes) == (0, 0)


def test_without_the_budget_the_broker_sends_the_whole_prefetch_at_once(make_consumer):
    consumer = make_consumer(max_body_bytes=16 * KIB, inflight_max_bytes=0)
    broker, pool = Broker(), Pool(solo=False)
    for i in range(12):
        broker.publish("budget.one", f"m{i}", 15 * KIB)
    loop, connection = started(consumer, broker, pool)
    run(consumer, broker, pool, loop, connection)
    assert broker.most_unacked == 12 and len(pool.handled) == 12


def test_one_body_larger_than_the_budget_is_handled_alone_and_consuming_goes_on(make_consumer):
    consumer = make_consumer(max_body_bytes=256 * KIB, inflight_max_bytes=48 * KIB)
    broker, pool = Broker(), Pool(solo=False)
    broker.publish("budget.one", "huge", 200 * KIB)
    for i in range(3):
        broker.publish("budget.one", f"m{i}", KIB)
    loop, connection = started(consumer, broker, pool)
    while broker.read_one() or loop.turn():
        pass
    assert [sub["prefetch"] for sub in broker.consumers.values()] == [], "over the budget: no consumer"
    assert broker.most_unacked == 1 and [args[4][3]["message_id"] for args, _ in pool.waiting] == ["huge"]
    run(consumer, broker, pool, loop, connection)
    assert pool.handled == [("budget.one", m) for m in ("huge", "m0", "m1", "m2")]
    assert len(broker.consumers) == 1, "consuming again once it was settled"


def test_more_queues_than_the_budget_holds_pause_and_resume_losing_and_reordering_nothing(make_consumer):
    # 3 queues, one body of max_body_bytes each fits 48 KiB only twice: every consumer gets prefetch 1,
    # and three bodies of 20 KiB (60 KiB) held at once put the worker over its budget.
    consumer = make_consumer(queues=3, max_body_bytes=24 * KIB, inflight_max_bytes=48 * KIB)
    broker, pool = Broker(), Pool(solo=False, limit=1)  # a pool of 3 would keep a prefetch of 3 each
    for i in range(10):
        for queue in QUEUES:
            broker.publish(queue, f"{queue}-{i}", 20 * KIB)
    loop, _ = started(consumer, broker, pool)
    paused = 0
    for _ in range(10_000):
        if not broker.consumers and broker.unacked:
            paused += 1
        if not (broker.read_one() or loop.turn() or pool.finish_oldest()):
            break
    assert paused, "the budget was never spent: the test shows nothing"
    assert broker.most_unacked <= 3, "one per queue at most"
    for queue in QUEUES:
        assert [m for q, m in pool.handled if q == queue] == [f"{queue}-{i}" for i in range(10)]
    assert len(pool.handled) == 30 and not broker.unacked and len(broker.consumers) == 3


def test_a_queue_paused_by_middleware_while_the_budget_is_spent_stays_paused_and_a_resume_waits(make_consumer):
    consumer = make_consumer(queues=2, max_body_bytes=64 * KIB, inflight_max_bytes=48 * KIB)
    broker, pool = Broker(), Pool(solo=False, limit=2)
    broker.publish("budget.one", "big", 60 * KIB)
    loop, connection = started(consumer, broker, pool)
    while broker.read_one() or loop.turn():
        pass
    assert consumer.throttle.throttled and not broker.consumers
    consumer.control.pause("budget.two", "breaker open")
    consumer.control.resume("budget.two", prefetch=1)  # e.g. a breaker's probe: waits for the budget
    consumer.control.pause("budget.one", "breaker open")
    loop.turn()
    assert not broker.consumers
    run(consumer, broker, pool, loop, connection)
    assert not consumer.throttle.throttled
    assert [sub["queue"] for sub in broker.consumers.values()] == ["budget.two"]
    assert [sub["prefetch"] for sub in broker.consumers.values()] == [1], "the probe's prefetch, kept"


def test_a_restart_while_the_budget_is_spent_consumes_again_on_the_new_connection(make_consumer):
    """Celery restarts the consumer blueprint on every reconnect: start -> stop -> start."""
    consumer = make_consumer(max_body_bytes=64 * KIB, inflight_max_bytes=48 * KIB)
    broker, pool = Broker(), Pool(solo=False)
    broker.publish("budget.one", "big", 60 * KIB)
    broker.publish("budget.one", "small", KIB)
    loop, connection = started(consumer, broker, pool)
    while broker.read_one() or loop.turn():
        pass
    assert consumer.throttle.throttled and consumer.budget.in_flight == 1
    consumer.stop()
    pool.waiting.clear()  # the old connection's job is lost with it (prefork drops unwritten jobs)
    loop, connection = started(consumer, broker, pool)  # closes the old channels: "big" goes back, redelivered
    assert not consumer.throttle.throttled and len(broker.consumers) == 1
    run(consumer, broker, pool, loop, connection)
    assert pool.handled == [("budget.one", "small")]
    assert [p[2] for p in consumer._channels[1].published] == ["big"], "redelivered: to the ladder, then acked"
    assert not broker.unacked and consumer.budget.in_flight == 0


def test_the_prefetch_never_leaves_the_pool_idle():
    """A pool that runs 50 handlers at once (gevent -c 50, async def handlers) gets at least 50 in flight, however
    small the budget's share; never more than asked."""
    budget = InflightBudget(max_bytes=48 * KIB, body_bytes=16 * KIB, consumers=1)
    assert budget.prefetch(100) == 3
    assert budget.prefetch(100, floor=50) == 50
    assert budget.prefetch(20, floor=50) == 20
    assert InflightBudget(max_bytes=0, body_bytes=1).prefetch(100, floor=50) == 100


@pytest.mark.parametrize("limit, queues, expected", [(50, 1, 50), (6, 3, 6), (1, 1, 3), (1, 3, 1)])
def test_a_consumer_s_prefetch_keeps_its_share_of_the_pool_busy(make_consumer, limit, queues, expected):
    consumer = make_consumer(queues=queues, max_body_bytes=16 * KIB, inflight_max_bytes=48 * KIB)
    broker = Broker()
    started(consumer, broker, Pool(solo=False, limit=limit))
    assert {sub["prefetch"] for sub in broker.consumers.values()} == {expected}
