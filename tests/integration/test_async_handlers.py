"""``async def`` handlers in a real worker: many in flight per prefork child, retries, the archive, middleware,
signals; refused at start-up under gevent."""
from __future__ import annotations

import collections
import importlib.util
import os
import time

import pytest

from kombu_events.publishing.publisher import Publisher, build_message

from .harness import get_messages, queue_counts, wait_for

pytestmark = pytest.mark.integration

N = 200
WAIT_S = 0.5

APP = f"""
import asyncio, contextvars
from kombu_events import signals

current = contextvars.ContextVar("current", default=None)

class Seen(Middleware):
    def handling(self, event):  # pool side, in the handler's own task
        return Context(event)

    def settled(self, delivery, outcome, step):
        record(kind="settled", id=delivery.message_id, action=step.action, attempt=delivery.attempt)

class Context:
    def __init__(self, event):
        self.event = event
    def __enter__(self):
        self.token = current.set(self.event.message_id)
    def __exit__(self, *exc):
        record(kind="context", id=self.event.message_id, same=current.get() == self.event.message_id,
               failed=exc[0] is not None)
        current.reset(self.token)

@signals.handler_failed.connect(weak=False)
def failed(sender, event, exception, action, **kwargs):
    record(kind="failed", id=event.message_id, exception=type(exception).__name__, action=action)

events = Events(app, service=SERVICE, exchange=EXCHANGE, delay_unit_ms=100, delay_levels=6, max_retries=3,
                middleware=[Seen()])

@events.handler("wait.#", bind=True)
async def wait(event):
    record(kind="start", id=event.message_id)
    await asyncio.sleep({WAIT_S})
    assert current.get() == event.message_id, "another handler's context"
    record(kind="end", id=event.message_id)

@events.handler("flaky.#", bind=True)
async def flaky(event):
    await asyncio.sleep(0.01)
    if event.payload["kind"] == "poison":
        raise Archive("poison, by design")
    if event.attempt == 1:
        raise RuntimeError("fails once, by design")
    record(kind="end", id=event.message_id, attempt=event.attempt)
"""


def publish(broker_url, exchange, items):
    publisher = Publisher(broker_url)
    try:
        batch = [(exchange, key, build_message(body, message_id=message_id)) for key, body, message_id in items]
        assert publisher.send_many(batch) == [None] * len(batch)
    finally:
        publisher.close()


def test_200_async_handlers_awaiting_half_a_second_prefork_c2_all_handled_once(make_project, broker_url):
    project = make_project(APP)
    project.worker(pool="prefork", concurrency=2).wait_ready()
    waits = [(f"wait.{i}", {"i": i}, f"w-{i}") for i in range(N)]
    flaky = [("flaky.1", {"kind": "once"}, "f-once"), ("flaky.2", {"kind": "poison"}, "f-poison")]
    publish(broker_url, project.exchange, [*waits, *flaky])
    wait_for(lambda: len(project.records(kind="settled")) >= N + 3, timeout=90, interval=0.3,
             what=f"{N + 3} settlements")
    time.sleep(0.5)  # a duplicate settlement would show by now

    starts = project.records(kind="start")
    ends = {r["id"]: r for r in project.records(kind="end")}
    assert sorted(r["id"] for r in starts) == sorted(m for _, _, m in waits), "each handled exactly once"
    settled = collections.defaultdict(list)
    for r in project.records(kind="settled"):
        settled[r["id"]].append((r["action"], r["attempt"]))
    assert all(settled[m] == [("ack", 1)] for _, _, m in waits), "each acked exactly once"
    elapsed = max(r["time"] for r in ends.values() if r["id"].startswith("w-")) - min(r["time"] for r in starts)
    peak = max(_overlap([r for r in starts if r["pid"] == pid], ends) for pid in {r["pid"] for r in starts})
    print(f"\n{N} handlers awaiting {WAIT_S} s, prefork -c 2: {elapsed:.2f} s from first start to last end; "
          f"at most {peak} in flight in one child")
    assert peak >= 10, "the children awaited them one by one"
    assert elapsed < 30, "a generous bound; benchmarks/ has the figure"

    # retries, the archive, handling() contexts and handler_failed work as for sync handlers
    assert settled["f-once"] == [("retry", 1), ("ack", 2)] and ends["f-once"]["attempt"] == 2
    assert settled["f-poison"] == [("archive", 1)]
    failed = {(r["id"], r["exception"], r["action"]) for r in project.records(kind="failed")}
    assert failed == {("f-once", "RuntimeError", "retry"), ("f-poison", "Archive", "archive")}
    contexts = project.records(kind="context")
    assert len(contexts) == N + 3 and all(r["same"] for r in contexts), "each context in its handler's task"
    assert {r["id"] for r in contexts if r["failed"]} == {"f-once", "f-poison"}
    (archived,) = get_messages(broker_url, f"{project.service}.archive")
    assert archived.properties["message_id"] == "f-poison"
    mine = {n: c[:2] for n, c in queue_counts(broker_url).items() if n.startswith(project.service + ".")}
    assert mine.pop(f"{project.service}.archive") == (1, 0), "the archive (a stream, read) keeps its one copy"
    assert all(c == (0, 0) for c in mine.values()), f"left in the broker: {mine}"


def _overlap(starts, ends):
    """Most handlers of ``starts`` running at one time (by their start and end records)."""
    moments = sorted([(r["time"], 1) for r in starts] + [(ends[r["id"]]["time"], -1) for r in starts])
    running = peak = 0
    for _, step in moments:
        running += step
        peak = max(peak, running)
    return peak


def test_under_gevent_a_worker_with_an_async_handler_refuses_to_start(make_project):
    if importlib.util.find_spec("gevent") is None:
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail("gevent is not installed (CI=true: must not skip)")
        pytest.skip("gevent is not installed")
    project = make_project(APP)
    worker = project.worker(pool="gevent", concurrency=10)
    assert worker.wait_exit(timeout=60) == 1
    log = worker.log
    assert (f"kombu-events: service {project.service} has async def handlers (flaky, wait) and the gevent pool "
            "runs handlers in greenlets") in log
    assert "run this worker with --pool=prefork, threads or solo, or define them with def" in log
    assert "Traceback" not in log
