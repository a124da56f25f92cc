"""async def handlers in the runner: awaited on the thread's loop, gathered in a batch, bounded, seen by middleware."""
from __future__ import annotations

import asyncio
import contextvars
import json
import os
import threading
from contextlib import contextmanager

import pytest

from kombu_events import registry, signals
from kombu_events.core import decision
from kombu_events.core.backoff import Exponential
from kombu_events.core.codec import JSON
from kombu_events.core.handlers import Handler
from kombu_events.errors import Archive, Retry
from kombu_events.middleware.base import Hooks, Middleware
from kombu_events.registry import Route
from kombu_events.worker import awaiting, runner

ACCEPT = frozenset({JSON})


@pytest.fixture(autouse=True)
def empty_registry():
    registry.reset()
    yield
    registry.reset()
    awaiting.refuse(None)


def put(fn, queue="svc.h", hooks=None, **options) -> str:
    values = {"name": queue.split(".")[-1], "queue": queue, "binding_keys": ("a.#",), "max_retries": 5,
              "backoff": Exponential()}
    values.update(options)
    registry._routes[queue] = Route(Handler(fn=fn, **values), ACCEPT, 2000, hooks or Hooks())
    return queue


def item(queue: str, payload, attempt=1, final=False) -> runner.Item:
    return (queue, json.dumps(payload).encode(), JSON, "utf-8", ("a.b", attempt, {}, {"message_id": str(payload)}),
            final)


def test_a_single_async_message_is_awaited_on_the_threads_loop_which_is_kept():
    loops = []

    async def handle(payload):
        loops.append(asyncio.get_running_loop())
        await asyncio.sleep(0)

    queue = put(handle)
    assert runner.run(*item(queue, 1)).kind == decision.OK
    assert runner.run(*item(queue, 2)).kind == decision.OK
    assert len(loops) == 2 and loops[0] is loops[1], "one loop per thread, reused"
    other = []
    thread = threading.Thread(target=lambda: other.append(runner.run(*item(queue, 3))))
    thread.start()
    thread.join()
    assert other[0].kind == decision.OK and loops[2] is not loops[0], "each thread its own loop"


def test_a_forked_child_does_not_reuse_its_parents_loop(monkeypatch):
    first = awaiting._loop()
    monkeypatch.setattr(os, "getpid", lambda: -1)
    assert awaiting._loop() is not first


def test_a_batch_runs_sync_handlers_in_order_and_awaits_async_ones_together_bounded():
    seen, in_flight, peak = [], [0], [0]

    def sync(payload):
        seen.append(("sync", payload))

    async def slow(payload):
        in_flight[0] += 1
        peak[0] = max(peak[0], in_flight[0])
        await asyncio.sleep(0.05)
        in_flight[0] -= 1
        seen.append(("async", payload))

    s, a = put(sync, "svc.sync"), put(slow, "svc.slow")
    items = [item(a, i) if i % 2 else item(s, i) for i in range(40)]
    loop_time = asyncio.new_event_loop()  # a clock only
    started = loop_time.time()
    outcomes = runner.run_batch(items, async_limit=5)
    elapsed = loop_time.time() - started
    loop_time.close()
    assert [o.kind for o in outcomes] == [decision.OK] * 40
    assert [p for kind, p in seen if kind == "sync"] == list(range(0, 40, 2)), "sync ones in order"
    assert sorted(p for kind, p in seen if kind == "async") == list(range(1, 40, 2))
    assert peak[0] == 5, "at most async_limit at once"
    assert elapsed < 20 * 0.05, "20 awaits of 50 ms, 5 at a time: about 0.2 s, not 1 s"


def test_in_a_batch_each_async_message_ends_in_its_own_outcome():
    async def handle(payload):
        await asyncio.sleep(0)
        if payload == "retry":
            raise Retry(delay=2)
        if payload == "archive":
            raise Archive("poison")
        if payload == "boom":
            raise ValueError("boom")
        if payload == "cancel":
            raise asyncio.CancelledError()

    queue = put(handle)
    outcomes = runner.run_batch([item(queue, p) for p in ("ok", "retry", "archive", "boom", "cancel", "ok")])
    assert [o.kind for o in outcomes] == [decision.OK, decision.RETRY, decision.ARCHIVE, decision.FAILED,
                                         decision.FAILED, decision.OK]
    assert outcomes[1].delay_ms == 2000 and outcomes[2].reason == "poison"
    assert "cancelled before it finished" in outcomes[4].reason
    assert runner.run_batch([item("svc.none", 1), item(queue, "ok")])[0].kind == decision.LOST


def test_signals_and_handling_contexts_see_each_async_handler_in_its_own_task():
    current = contextvars.ContextVar("current", default=None)
    log = []

    class Spans(Middleware):
        @contextmanager
        def handling(self, event):
            token = current.set(event.payload)  # as tracing does: per task, never another handler's
            log.append(("enter", event.payload))
            try:
                yield
            finally:
                log.append(("exit", event.payload, current.get()))
                current.reset(token)

    async def handle(event):
        assert current.get() == event.payload
        await asyncio.sleep(0.01 * (3 - event.payload))  # they finish in reverse order
        assert current.get() == event.payload
        if event.payload == 2:
            raise ValueError("two")

    queue = put(handle, hooks=Hooks([Spans()]), bind=True)
    started, failed, succeeded = [], [], []
    signals.handler_started.connect(lambda sender, event, **kw: started.append(event.payload), weak=False,
                                    dispatch_uid="t-started")
    signals.handler_failed.connect(lambda sender, event, exception, **kw: failed.append((event.payload, exception)),
                                   weak=False, dispatch_uid="t-failed")
    signals.handler_succeeded.connect(lambda sender, event, duration_ms, **kw: succeeded.append(event.payload),
                                      weak=False, dispatch_uid="t-succeeded")
    try:
        outcomes = runner.run_batch([item(queue, i) for i in range(3)])
    finally:
        for name in ("started", "failed", "succeeded"):
            getattr(signals, f"handler_{name}").disconnect(dispatch_uid=f"t-{name}")
    assert [o.kind for o in outcomes] == [decision.OK, decision.OK, decision.FAILED]
    assert [e for e in log if e[0] == "enter"] == [("enter", 0), ("enter", 1), ("enter", 2)]
    assert [e for e in log if e[0] == "exit"] == [("exit", 2, 2), ("exit", 1, 1), ("exit", 0, 0)]
    assert sorted(started) == [0, 1, 2] and sorted(succeeded) == [0, 1]
    assert [(p, str(e)) for p, e in failed] == [(2, "two")]


def test_a_context_that_raises_retry_ends_an_async_attempt_as_a_retry():
    class Steering(Middleware):
        @contextmanager
        def handling(self, event):
            raise Retry(delay=1)
            yield  # pragma: no cover

    ran = []

    async def handle(payload):
        ran.append(payload)

    queue = put(handle, hooks=Hooks([Steering()]))
    assert runner.run(*item(queue, 1)).kind == decision.RETRY
    assert ran == []


def test_from_inside_a_running_loop_the_coroutine_runs_on_a_helper_thread():
    async def handle(payload):
        return threading.current_thread().name

    queue = put(handle)

    async def test_body():
        return runner.run(*item(queue, 1))

    assert asyncio.run(test_body()).kind == decision.OK


def test_where_coroutines_are_refused_an_async_handler_fails_and_a_wrapped_one_is_archived():
    async def body(payload):
        raise AssertionError("never runs")

    def wrapper(payload):
        return body(payload)

    awaited, wrapped = put(body, "svc.awaited"), put(wrapper, "svc.wrapped")
    awaiting.refuse("the gevent pool runs handlers in greenlets")
    outcome = runner.run(*item(awaited, 1))
    assert outcome.kind == decision.FAILED and "gevent" in outcome.reason
    outcome = runner.run(*item(wrapped, 1))
    assert outcome.kind == decision.ARCHIVE and "cannot be awaited here: the gevent pool" in outcome.reason
    assert [o.kind for o in runner.run_batch([item(awaited, 1)])] == [decision.FAILED]
