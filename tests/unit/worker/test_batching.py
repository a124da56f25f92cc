"""Batched hand-off to the pool: the Batcher's rules, and the consumer settling each message of a batch on its own."""
from __future__ import annotations

import json
import pickle
from types import SimpleNamespace
from unittest.mock import MagicMock

import pytest
from celery import Celery
from celery.exceptions import WorkerShutdown

from kombu_events import Events, registry
from kombu_events.core import decision
from kombu_events.worker import awaiting, runner
from kombu_events.worker.batching import BUDGET_MS, MAX_MESSAGES, Batcher, max_messages
from kombu_events.worker.consumer import ServiceConsumer

# -- the Batcher (pure) ------------------------------------------------------------------------------------


@pytest.mark.parametrize("in_flight, processes, expected", [
    (100, 2, 50), (100, 1, MAX_MESSAGES), (1000, 2, MAX_MESSAGES), (100, 8, 12), (3, 8, 1), (0, 0, 1)])
def test_a_batch_is_a_share_of_the_prefetch_per_process_at_most_max_messages(in_flight, processes, expected):
    assert max_messages(in_flight=in_flight, processes=processes) == expected


def test_the_first_message_of_a_queue_goes_alone_then_the_average_decides():
    batcher: Batcher[int] = Batcher(max_messages=50)
    batcher.overhead_ms = 0.0
    assert batcher.add("q", 1), "not run yet: it counts as the whole budget"
    assert batcher.take() == [1] and len(batcher) == 0
    batcher.observe("q", 1.0)  # 1 ms each: 10 fit the 10 ms budget
    assert [batcher.add("q", i) for i in range(10)] == [False] * 9 + [True]
    assert batcher.take() == list(range(10))


def test_what_a_batch_costs_besides_its_handlers_is_learnt_and_counted():
    batcher: Batcher[int] = Batcher(max_messages=100, awaited=frozenset({"aio"}))
    assert batcher.overhead_ms == 1.0, "unknown: rather too much"
    for _ in range(60):  # 9 sync messages, 0.9 ms of handlers, 18.9 ms before awaiting: 2 ms each besides
        batcher.observe_batch([("q", 0.1)] * 9 + [("aio", 500.0)], elapsed_ms=18.9)
    assert batcher.overhead_ms == pytest.approx(2.0, abs=0.01)
    assert batcher.cost_ms("q") == pytest.approx(0.1)
    assert [batcher.add("q", i) for i in range(5)] == [False, False, False, False, True], "5 x 2.1 ms > 10 ms"
    batcher.take()
    assert [batcher.add("aio", i) for i in range(5)] == [False] * 5, "awaited: only max_messages counts"
    batcher.observe_batch([], elapsed_ms=5.0)
    batcher.observe_batch([("q", 0.1)], elapsed_ms=-1.0)  # a batch from a pool that did not say
    assert batcher.overhead_ms == pytest.approx(2.0, abs=0.01)


def test_with_no_budget_sync_messages_go_one_by_one_and_async_ones_wait_for_company():
    batcher: Batcher[int] = Batcher(max_messages=3, awaited=frozenset({"aio"}), budget_ms=0.0)  # solo
    batcher.observe("q", 0.001)
    assert [batcher.add("aio", 1), batcher.add("aio", 2)] == [False, False]
    assert batcher.add("q", 3), "a sync message: the batch goes now"
    assert batcher.take() == [1, 2, 3]
    assert [batcher.add("aio", i) for i in range(3)] == [False, False, True]


def test_fast_handlers_fill_the_batch_up_to_max_messages():
    batcher: Batcher[int] = Batcher(max_messages=3)
    batcher.observe("q", 0.01)
    assert [batcher.add("q", i) for i in range(3)] == [False, False, True]


def test_a_slow_handler_goes_one_by_one_and_the_average_follows_the_durations():
    batcher: Batcher[int] = Batcher(max_messages=50)
    batcher.overhead_ms = 0.0
    batcher.observe("slow", 200.0)
    assert batcher.add("slow", 1)
    batcher.take()
    for _ in range(40):
        batcher.observe("slow", 0.5)
    assert batcher.cost_ms("slow") == pytest.approx(0.5, abs=0.05)
    assert not batcher.add("slow", 2), "fast now: it waits for company"


def test_async_handlers_count_only_towards_max_messages():
    batcher: Batcher[int] = Batcher(max_messages=4, awaited=frozenset({"aio"}))
    batcher.observe("aio", 500.0)  # awaiting overlaps: never an average
    assert batcher.cost_ms("aio") is None
    assert [batcher.add("aio", i) for i in range(4)] == [False, False, False, True]


def test_nan_or_negative_durations_are_ignored():
    batcher: Batcher[int] = Batcher(max_messages=4)
    batcher.observe("q", float("nan"))
    batcher.observe("q", -1.0)
    assert batcher.cost_ms("q") is None and BUDGET_MS > 0


# -- the consumer: batches handed over, each message settled on its own ------------------------------------


class Pool:
    """A pool that runs nothing: it keeps what it is handed (function, args, callback, error_callback)."""

    limit = 2

    def __init__(self) -> None:
        self.jobs: list[tuple] = []

    def apply_async(self, fn, args, callback, error_callback):
        self.jobs.append((fn, args, callback, error_callback))


class Message:
    def __init__(self, i: int) -> None:
        self.body = json.dumps({"i": i}).encode()
        self.properties = {"message_id": f"m{i}", "content_type": "application/json"}
        self.delivery_info = {"routing_key": "orders.created", "redelivered": False}


@pytest.fixture
def consumer(monkeypatch):
    registry.reset()
    app = Celery("t", broker="memory://")
    events = Events(app, service="batch")

    @events.handler("orders.#")
    def handle(payload):
        pass

    @events.handler("aio.#")
    async def awaited(payload):
        pass

    registry.resolve(app)
    consumer = ServiceConsumer(events)
    consumer.handoff.pool = Pool()
    consumer.settled = []
    monkeypatch.setattr(consumer.settler, "settle", lambda route, delivery, message, result:
                        consumer.settled.append((delivery.message_id, result)))
    yield consumer
    registry.reset()


def receive(consumer, ids, more=True):
    consumer.handoff.more_to_read = lambda: more
    route = consumer.routes[0]
    for i in ids:
        consumer._receive(route, Message(i))


def test_without_more_to_read_a_lone_message_goes_at_once_as_before(consumer):
    consumer.handoff.batch.max_messages = 50
    consumer.handoff.batch.observe("batch.handle", 0.01)  # fast: only the read's end makes it go
    receive(consumer, [1], more=False)
    ((fn, args, callback, _),) = consumer.handoff.pool.jobs
    assert fn is runner.run and args[0] == "batch.handle"
    callback(decision.Outcome(decision.OK, duration_ms=0.01))
    assert consumer.settled == [("m1", decision.Outcome(decision.OK, duration_ms=0.01))]


def test_what_one_read_brings_goes_as_one_job_and_each_message_settles_on_its_own(consumer):
    consumer.handoff.batch.max_messages = 50
    consumer.handoff.batch.observe("batch.handle", 0.01)
    receive(consumer, range(5), more=True)
    assert consumer.handoff.pool.jobs == [], "the connection has more: the batch waits"
    consumer.handoff.more_to_read = lambda: False
    consumer.handoff.tick()
    ((fn, (items, limit), callback, _),) = consumer.handoff.pool.jobs
    assert fn is runner.run_batch and limit == consumer.settings.async_concurrency == 100
    assert [json.loads(item[1])["i"] for item in items] == list(range(5))
    outcomes = runner.Outcomes(decision.Outcome(decision.OK if i % 2 else decision.FAILED, duration_ms=0.02)
                               for i in range(5))
    outcomes.elapsed_ms = 5.1
    callback(pickle.loads(pickle.dumps(outcomes)))  # as from a prefork child
    assert consumer.settled == [(f"m{i}", outcomes[i]) for i in range(5)]
    assert consumer.handoff.batch.overhead_ms == pytest.approx(1.0), "(5.1 - 5 x 0.02) / 5 = 1.0 ms besides the handler"


def test_a_full_batch_goes_without_waiting_for_the_read_to_end(consumer):
    consumer.handoff.batch.max_messages = 3
    consumer.handoff.batch.observe("batch.handle", 0.01)
    receive(consumer, range(7), more=True)
    assert [len(args[0]) for _, args, _, _ in consumer.handoff.pool.jobs] == [3, 3]
    consumer.stop()  # what is left goes to the pool: nothing received is kept back
    jobs = consumer.handoff.pool.jobs
    assert [len(args) if fn is runner.run else len(args[0]) for fn, args, _, _ in jobs] == [3, 3, 6]


def test_a_lost_batch_goes_back_to_the_pool_one_message_at_a_time_no_attempt_spent(consumer, caplog):
    consumer.handoff.batch.max_messages = 4
    consumer.handoff.batch.observe("batch.handle", 0.01)
    receive(consumer, range(4))
    ((_, _, _, error_callback),) = consumer.handoff.pool.jobs
    lost = SimpleNamespace(exception=RuntimeError("Worker exited prematurely: signal 9 (SIGKILL)"), traceback="")
    error_callback(lost)
    assert consumer.settled == [], "nothing settled: no attempt spent"
    again = consumer.handoff.pool.jobs[1:]
    assert [(fn, json.loads(args[1])["i"]) for fn, args, _, _ in again] == [(runner.run, i) for i in range(4)]
    assert consumer.handoff.jobs == 4, "the batch's job returned, four single ones out"
    assert "died holding a batch of 4 messages" in caplog.text and "SIGKILL" in caplog.text
    (_, _, _, single_lost) = again[2]
    single_lost(lost)  # the one that kills its process again: lost alone, an attempt spent (decision.lost)
    assert consumer.settled == [("m2", lost)]


def test_a_lost_batch_refused_by_a_pool_shutting_down_is_left_unacked_not_archived(consumer, monkeypatch):
    consumer.handoff.batch.max_messages = 3
    consumer.handoff.batch.observe("batch.handle", 0.01)
    receive(consumer, range(3))
    ((_, _, _, error_callback),) = consumer.handoff.pool.jobs
    held = []
    monkeypatch.setattr(consumer.settler, "announce", lambda route, delivery, outcome, step:
                        held.append((delivery.message_id, step)))

    def closed(fn, args, callback, error_callback):
        raise ValueError("Pool not running")

    consumer.handoff.pool.apply_async = closed
    error_callback(SimpleNamespace(exception=RuntimeError("Worker exited prematurely"), traceback=""))
    assert consumer.settled == [], "not archived"
    assert [(m, step.action) for m, step in held] == [("m0", "held"), ("m1", "held"), ("m2", "held")]
    assert "Pool not running" in held[0][1].reason and "left unacked" in held[0][1].reason


def test_a_batch_that_cannot_be_handed_over_goes_one_by_one(consumer):
    class Refusing(Pool):
        def apply_async(self, fn, args, callback, error_callback):
            if fn is runner.run_batch or json.loads(args[1])["i"] == 2:
                raise RecursionError("too deep to pickle")
            super().apply_async(fn, args, callback, error_callback)

    consumer.handoff.pool = Refusing()
    consumer.handoff.batch.max_messages = 4
    consumer.handoff.batch.observe("batch.handle", 0.01)
    receive(consumer, range(4))
    assert [json.loads(args[1])["i"] for _, args, _, _ in consumer.handoff.pool.jobs] == [0, 1, 3]
    ((message_id, outcome),) = consumer.settled
    assert message_id == "m2" and outcome.kind == decision.UNDECODABLE
    assert "cannot be handed to the pool" in outcome.reason


def test_under_a_green_pool_an_async_handler_stops_the_worker_at_start(consumer, caplog):
    class TaskPool:
        __module__ = "celery.concurrency.gevent"
        is_green = True

    green = TaskPool()
    try:
        with pytest.raises(WorkerShutdown):
            consumer._check_pool(green)
        assert "async def handlers (awaited) and the gevent pool runs handlers in greenlets" in caplog.text
        assert "--pool=prefork, threads or solo" in caplog.text
        assert awaiting.refused() is not None
    finally:
        awaiting.refuse(None)
    consumer._check_pool(Pool())  # any other pool: nothing to refuse


def test_while_every_process_is_busy_messages_wait_and_go_together_when_one_is_free(consumer):
    consumer.handoff.batch.max_messages, consumer.handoff.processes = 50, 1
    consumer.handoff.batch.observe("batch.handle", 0.01)
    receive(consumer, [0], more=False)
    ((_, _, first_done, _),) = consumer.handoff.pool.jobs  # the only process is busy with it
    receive(consumer, [1, 2, 3], more=False)  # one by one, each read ends: they wait all the same
    consumer.handoff.tick()
    assert len(consumer.handoff.pool.jobs) == 1
    first_done(decision.Outcome(decision.OK, duration_ms=0.01))
    (_, (fn, (items, _), _, _)) = consumer.handoff.pool.jobs
    assert fn is runner.run_batch and [json.loads(item[1])["i"] for item in items] == [1, 2, 3]


def test_a_batch_that_waited_too_long_for_a_free_process_goes_anyway(consumer, monkeypatch):
    handoff = consumer.handoff
    handoff.batch.max_messages, handoff.processes, handoff.jobs = 50, 1, 1  # a job that never came back
    consumer.handoff.batch.observe("batch.handle", 0.01)
    receive(consumer, [1, 2], more=False)
    consumer.handoff.tick()
    assert consumer.handoff.pool.jobs == []
    monkeypatch.setattr(consumer.handoff, "since", consumer.handoff.since - 2.0)
    consumer.handoff.tick()
    assert [len(args[0]) for _, args, _, _ in consumer.handoff.pool.jobs] == [2]


def test_jobs_the_pool_dropped_at_a_reconnect_hold_back_no_batch_after_it(consumer, monkeypatch):
    """At a connection loss Celery's prefork pool drops the jobs it had not yet written to a process
    (AsynPool.flush): they never call back. Still counted, they kept every later batch waiting for a
    free process that the count never showed; at a queue's end, for as long as the event loop slept."""
    monkeypatch.setattr("kombu_events.worker.consumer.declare", lambda topology, connection: None)
    monkeypatch.setattr(consumer, "_open_publisher", MagicMock)
    consumer.handoff.pool.limit = 2
    consumer.start(MagicMock(), consumer.handoff.pool, MagicMock(on_tick=set()))
    consumer.handoff.batch.observe("batch.handle", 0.01)
    receive(consumer, [1], more=False)
    receive(consumer, [2], more=False)
    (_, _, running, _), _dropped = consumer.handoff.pool.jobs  # both processes busy; the second job will never return
    consumer.start(MagicMock(), consumer.handoff.pool, MagicMock(on_tick=set()))  # Celery's reconnect
    receive(consumer, [3], more=False)
    assert [len(consumer.handoff.pool.jobs), consumer.handoff.jobs] == [3, 1], \
        "handed over at once: no process is counted busy"
    running(decision.Outcome(decision.OK, duration_ms=0.01))  # a job of the old connection, back late
    assert consumer.handoff.jobs == 1, "it frees no process counted on this connection"
    receive(consumer, [4, 5], more=True)
    receive(consumer, [6], more=False)
    assert [json.loads(item[1])["i"] for item in consumer.handoff.pool.jobs[-1][1][0]] == [4, 5, 6]


def test_a_waiting_batch_sets_a_timer_so_an_idle_event_loop_still_hands_it_over_after_a_second(consumer,
                                                                                                monkeypatch):
    """The event loop ticks before each poll, and with nothing to do it polls for up to 10 s."""
    timers = []
    consumer.handoff.hub = SimpleNamespace(call_later=lambda delay, fn: timers.append((delay, fn)))
    handoff = consumer.handoff
    handoff.batch.max_messages, handoff.processes, handoff.jobs = 50, 1, 1  # its process busy
    consumer.handoff.batch.observe("batch.handle", 0.01)
    receive(consumer, [1, 2], more=False)
    assert [delay for delay, _ in timers] == [1.0], "one timer, when the batch began to wait"
    (_, fire), = timers
    monkeypatch.setattr(consumer.handoff, "since", consumer.handoff.since - 1.0)
    fire()
    assert [len(args[0]) for _, args, _, _ in consumer.handoff.pool.jobs] == [2]
