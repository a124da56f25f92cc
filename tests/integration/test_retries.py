"""Retries through the broker-side delay ladder, and the archive, with real `celery worker` processes.

Every test has its own service and events exchange (``make_project`` deletes all of
their queues and exchanges, even on failure). Delays are short: 100 ms units, 8 levels.
"""
from __future__ import annotations

import json
import time
from datetime import datetime
from typing import Any

import pytest

from kombu_events.testing import temporary_vhost

from .harness import (
    Project,
    management_queue,
    peek_messages,
    publish_amqp,
    queue_depth,
    unique,
    wait_for,
)

pytestmark = pytest.mark.integration

LEVELS = 8
SETTINGS = f"delay_unit_ms=100, delay_levels={LEVELS}"
BACKOFF = "Exponential(base_ms=200, max_delay_ms=1000)"
EPSILON = 0.05  # clock granularity between records written by different processes
SLACK = 1.5  # broker, worker loop and pool latency on top of a delay
# A "nothing more arrives" wait lasts the delay it guards plus this; shorter than SLACK because a
# late straggler can only go unnoticed, never fail a correct run.
QUIET = 0.5

PRELUDE = """
def plain(value):
    return json.loads(json.dumps(value, default=str))

def note(event, handler, **more):
    record(handler=handler, attempt=event.attempt, routing_key=event.routing_key, queue=event.queue,
           message_id=event.message_id, body=event.body.hex(), body_type=type(event.body).__name__,
           headers=plain(event.headers),
           properties=plain({k: v for k, v in event.properties.items() if k != "application_headers"}),
           payload=event.payload, **more)
"""


@pytest.fixture
def make_project(make_project):
    """The shared fixture, with this file's recording helpers in front of every body."""
    return lambda body: make_project(PRELUDE + body)


def send(project: Project, routing_key: str, payload: Any = None, *, body: bytes | None = None,
         **properties: Any) -> str:
    """Publish one JSON event to the project's exchange with a fresh message id; return it."""
    properties.setdefault("message_id", unique("m"))
    properties.setdefault("content_type", "application/json")
    data = body if body is not None else json.dumps(payload if payload is not None else {}).encode()
    publish_amqp(project.broker_url, project.exchange, routing_key, data, **properties)
    return properties["message_id"]


def calls(project: Project, handler: str | None = None, message_id: str | None = None) -> list[dict]:
    return [r for r in project.records()
            if (handler is None or r["handler"] == handler) and (message_id is None or r["message_id"] == message_id)]


def archive_of(project: Project) -> str:
    return f"{project.service}.archive"


def wait_archived(project: Project, count: int = 1, timeout: float = 20.0) -> list[Any]:
    """Wait until the archive holds ``count`` messages; return them (left in the archive)."""
    wait_for(lambda: queue_depth(project.broker_url, archive_of(project))[0] >= count, timeout,
             what=f"{count} archived message(s)")
    return peek_messages(project.broker_url, archive_of(project))


def ladder_depth(project: Project) -> int:
    return sum(queue_depth(project.broker_url, f"{project.service}.delay.{level}")[0] for level in range(LEVELS))


def user_headers(headers: dict) -> dict:
    """Headers the publisher set: without ours and without the broker's dead-lettering ones."""
    return {k: v for k, v in headers.items()
            if not k.startswith(("kombu-events-", "x-death", "x-first-death-", "x-last-death-"))}


def assert_gaps(times: list[float], delays_s: list[float]) -> None:
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert len(gaps) == len(delays_s), gaps
    for gap, delay in zip(gaps, delays_s):
        assert delay - EPSILON <= gap < delay + SLACK, f"gaps {gaps} do not follow delays {delays_s}"


# -- 1. backoff, attempt counter, message kept intact ----------------------------------------

FLAKY = f"""
events = Events(app, service=SERVICE, exchange=EXCHANGE, {SETTINGS})

@events.handler("orders.*.created", bind=True, max_retries=5, backoff={BACKOFF})
def flaky(event):
    note(event, "flaky")
    if event.attempt < 3:
        raise RuntimeError(f"flaky failure on attempt {{event.attempt}}")
"""


def test_failing_twice_then_succeeding_follows_backoff_and_keeps_the_message_intact(make_project):
    project = make_project(FLAKY)
    project.worker().wait_ready()
    body = '{ "order_id": 42,  "note": "caf\u00e9 \u2713" }'.encode()  # not canonical JSON: bytes must survive
    properties = {
        "message_id": unique("m"), "correlation_id": unique("c"), "content_type": "application/json",
        "content_encoding": "utf-8", "timestamp": 1_700_000_000, "delivery_mode": 2, "app_id": "shop",
        "type": "order.created", "reply_to": "nowhere",
        "application_headers": {"x-request-id": "req-123", "tenant": "acme", "n": 7},
    }
    send(project, "orders.42.created", body=body, **properties)

    records = wait_for(lambda: len(calls(project)) >= 3 and calls(project), what="three attempts")
    time.sleep(0.8 + QUIET)  # a fourth call would follow the next backoff step, 800 ms
    records = calls(project)
    assert [r["attempt"] for r in records] == [1, 2, 3]
    assert_gaps([r["time"] for r in records], [0.2, 0.4])
    for r in records:
        assert r["body"] == body.hex()
        assert r["routing_key"] == "orders.42.created"
        assert r["queue"] == f"{project.service}.flaky"
        assert r["payload"] == {"order_id": 42, "note": "caf\u00e9 \u2713"}
        assert user_headers(r["headers"]) == {"x-request-id": "req-123", "tenant": "acme", "n": 7}
        expected = {k: v for k, v in properties.items() if k != "application_headers"}
        assert {k: r["properties"].get(k) for k in expected} == expected
    assert ladder_depth(project) == 0
    assert queue_depth(project.broker_url, archive_of(project))[0] == 0
    assert queue_depth(project.broker_url, f"{project.service}.flaky")[0] == 0


# -- 2. a retry goes back only to the queue that failed ---------------------------------------

TWO_HANDLERS = f"""
events = Events(app, service=SERVICE, exchange=EXCHANGE, {SETTINGS}, backoff={BACKOFF})

@events.handler("orders.#", bind=True)
def fails_once(event):
    note(event, "fails_once")
    if event.attempt == 1:
        raise RuntimeError("first attempt fails")

@events.handler("orders.#", bind=True)
def steady(event):
    note(event, "steady")
"""


def test_retry_returns_only_to_the_queue_that_failed(make_project):
    project = make_project(TWO_HANDLERS)
    project.worker().wait_ready()
    ids = [send(project, f"orders.{n}.created", {"n": n}) for n in range(5)]

    wait_for(lambda: len(calls(project, "fails_once")) >= 10, what="every event retried once")
    time.sleep(0.2 + QUIET)  # a copy sent to the wrong queue would wait the same 200 ms step as the retry
    for message_id in ids:
        assert [r["attempt"] for r in calls(project, "fails_once", message_id)] == [1, 2]
        assert [r["attempt"] for r in calls(project, "steady", message_id)] == [1]
    assert len(calls(project)) == 15
    assert ladder_depth(project) == 0


# -- 3. Retry(delay=seconds) ------------------------------------------------------------------

RETRY_ONE_SECOND = f"""
events = Events(app, service=SERVICE, exchange=EXCHANGE, {SETTINGS}, backoff={BACKOFF})

@events.handler("orders.#", bind=True)
def later(event):
    note(event, "later")
    if event.attempt == 1:
        raise Retry(delay=1)
"""


def test_retry_with_explicit_delay_waits_that_long(make_project):
    project = make_project(RETRY_ONE_SECOND)
    project.worker().wait_ready()
    send(project, "orders.1.created", {"n": 1})

    records = wait_for(lambda: len(calls(project)) >= 2 and calls(project), what="the second attempt")
    assert [r["attempt"] for r in records] == [1, 2]
    gap = records[1]["time"] - records[0]["time"]
    assert 1.0 - EPSILON <= gap < 1.0 + 1.0, gap


# -- 4. Archive(reason) -----------------------------------------------------------------------

ARCHIVE = f"""
events = Events(app, service=SERVICE, exchange=EXCHANGE, {SETTINGS}, backoff={BACKOFF})

def deep(n):
    if n == 0:
        raise Archive("bad order")
    deep(n - 1)

@events.handler("orders.#", bind=True)
def reject(event):
    note(event, "reject")
    deep(60)  # a long traceback: the header must stay bounded
"""


def test_archive_exception_archives_at_once_with_failure_headers(make_project):
    project = make_project(ARCHIVE)
    project.worker().wait_ready()
    body = b'{"order_id": 7}'
    message_id = send(project, "orders.7.created", body=body,
                      application_headers={"x-request-id": "req-7"}, correlation_id="corr-7")

    [archived] = wait_archived(project)
    time.sleep(0.2 + QUIET)  # no retry may follow: it would come after the first backoff step, 200 ms
    assert [r["attempt"] for r in calls(project)] == [1]
    headers = archived.headers
    assert "bad order" in headers["kombu-events-reason"]
    assert headers["kombu-events-queue"] == f"{project.service}.reject"
    assert headers["kombu-events-routing-key"] == "orders.7.created"
    assert headers["kombu-events-attempts"] == 1
    assert "Archive" in headers["kombu-events-exception"] and "bad order" in headers["kombu-events-exception"]
    traceback = headers["kombu-events-traceback"]
    assert "bad order" in traceback
    assert 0 < len(traceback) <= 2000  # the default traceback_limit; the full one is far longer
    datetime.fromisoformat(headers["kombu-events-archived-at"])
    assert headers["x-request-id"] == "req-7"
    assert archived.body == body
    assert archived.properties["message_id"] == message_id
    assert archived.properties["correlation_id"] == "corr-7"
    assert ladder_depth(project) == 0
    assert queue_depth(project.broker_url, f"{project.service}.reject")[0] == 0


# -- 5. poisonous(), dont_retry, max_retries -----------------------------------------------------

POISON = f"""
events = Events(app, service=SERVICE, exchange=EXCHANGE, {SETTINGS}, backoff={BACKOFF})

@events.handler("orders.#", bind=True)
def poisoned(event):
    note(event, "poisoned")
    with poisonous():
        raise ValueError("cannot parse order")
"""

DONT_RETRY = f"""
events = Events(app, service=SERVICE, exchange=EXCHANGE, {SETTINGS}, backoff={BACKOFF})

@events.handler("orders.#", bind=True, dont_retry=(ValueError,))
def picky(event):
    note(event, "picky")
    raise ValueError("cannot parse order")
"""


@pytest.mark.parametrize("body, expected", [(POISON, "poisonous"), (DONT_RETRY, "dont_retry")],
                         ids=["poisonous", "dont_retry"])
def test_unretryable_failures_are_archived_at_once(make_project, body, expected):
    project = make_project(body)
    project.worker().wait_ready()
    send(project, "orders.3.created", {"n": 3})

    [archived] = wait_archived(project)
    time.sleep(0.2 + QUIET)  # no retry may follow: it would come after the first backoff step, 200 ms
    assert [r["attempt"] for r in calls(project)] == [1]
    reason = archived.headers["kombu-events-reason"]
    assert expected in reason and "ValueError" in reason and "cannot parse order" in reason
    assert archived.headers["kombu-events-attempts"] == 1
    assert ladder_depth(project) == 0


ALWAYS_FAILS = f"""
events = Events(app, service=SERVICE, exchange=EXCHANGE, {SETTINGS})

@events.handler("orders.#", bind=True, max_retries=2, backoff={BACKOFF})
def hopeless(event):
    note(event, "hopeless")
    raise RuntimeError("still broken")
"""


def test_max_retries_exhausted_archives_after_the_last_attempt(make_project):
    project = make_project(ALWAYS_FAILS)
    project.worker().wait_ready()
    send(project, "orders.4.created", {"n": 4})

    [archived] = wait_archived(project)
    time.sleep(0.8 + QUIET)  # a fourth attempt would follow the third backoff step, 800 ms
    records = calls(project)
    assert [r["attempt"] for r in records] == [1, 2, 3]
    assert_gaps([r["time"] for r in records], [0.2, 0.4])
    headers = archived.headers
    assert "max_retries" in headers["kombu-events-reason"] and "still broken" in headers["kombu-events-reason"]
    assert headers["kombu-events-attempts"] == 3
    assert "RuntimeError" in headers["kombu-events-exception"]
    assert ladder_depth(project) == 0


# -- 6. a pool process that dies ----------------------------------------------------------------

CRASHY = f"""
events = Events(app, service=SERVICE, exchange=EXCHANGE, {SETTINGS}, backoff={BACKOFF})

@events.handler("jobs.#", bind=True, max_retries=2)
def crashy(event):
    note(event, "crashy")
    if event.payload.get("die"):
        os._exit(1)
"""


def test_pool_process_exiting_ends_in_archive_and_worker_keeps_consuming(make_project):
    project = make_project(CRASHY)
    worker = project.worker(pool="prefork", concurrency=2).wait_ready()
    killer = send(project, "jobs.kill", {"die": True})

    # billiard takes a few seconds to notice each dead child
    [archived] = wait_archived(project, timeout=60)
    assert [r["attempt"] for r in calls(project, message_id=killer)] == [1, 2, 3]
    headers = archived.headers
    assert "pool process" in headers["kombu-events-reason"], headers["kombu-events-reason"]
    assert headers["kombu-events-attempts"] == 3
    assert archived.properties["message_id"] == killer

    good = send(project, "jobs.fine", {"die": False})
    wait_for(lambda: calls(project, message_id=good), timeout=20, what="a later good event handled")
    assert worker.proc.poll() is None
    assert [r["attempt"] for r in calls(project, message_id=good)] == [1]


# -- 7. nothing held unacked while the ladder holds the retries ------------------------------------

BURST = f"""
events = Events(app, service=SERVICE, exchange=EXCHANGE, {SETTINGS}, prefetch_count=50)

@events.handler("orders.#", bind=True)
def overloaded(event):
    note(event, "overloaded")
    if event.attempt == 1:
        raise Retry(delay=20)  # long enough to watch the management API's 5 s statistics
"""


def test_failure_burst_leaves_no_unacked_messages_while_the_ladder_holds_them(make_project):
    project = make_project(BURST)
    project.worker().wait_ready()
    count = 20
    for n in range(count):
        send(project, f"orders.{n}.created", {"n": n})
    wait_for(lambda: len(calls(project)) >= count, what="every first attempt")
    queue = f"{project.service}.overloaded"

    def settled() -> dict | None:
        # The API refreshes every few seconds, and a snapshot can carry the ack counter before
        # the queue's message counts (or without them): wait for one with every ack and no
        # unacked message. Held by the worker, they would stay unacked for the whole 20 s delay.
        stats = management_queue(project.broker_url, queue)
        acks = (stats.get("message_stats") or {}).get("ack", 0)
        unacked = stats.get("messages_unacknowledged")
        return stats if acks >= count and unacked == 0 else None

    stats = wait_for(settled, timeout=15, interval=0.5, what="management stats: every ack, none unacked")
    assert ladder_depth(project) == count  # they wait in the broker, not in the worker
    assert stats["messages_ready"] == 0
    assert queue_depth(project.broker_url, queue)[0] == 0
    assert [r["attempt"] for r in calls(project)] == [1] * count


# -- the body a handler gets is the bytes on the wire --------------------------------------------

BYTES = f"""
events = Events(app, service=SERVICE, exchange=EXCHANGE, {SETTINGS})

@events.handler("raw.#", raw=True)
def raw(payload):
    record(handler="raw", message_id=None, type=type(payload).__name__)

@events.handler("bound.#", bind=True)
def bound(event):
    record(handler="bound", message_id=event.message_id, type=type(event.body).__name__)
"""


def test_handlers_get_the_body_as_bytes_even_with_a_content_encoding(make_project):
    project = make_project(BYTES)
    project.worker().wait_ready()
    send(project, "raw.1", {"n": 1}, content_encoding="utf-8")
    send(project, "bound.1", {"n": 1}, content_encoding="utf-8")

    wait_for(lambda: len(calls(project)) >= 2, what="both handlers called")
    assert {r["handler"]: r["type"] for r in calls(project)} == {"raw": "bytes", "bound": "bytes"}


REJECTED = f"""
events = Events(app, service=SERVICE, exchange=EXCHANGE, {SETTINGS}, max_retries=3)

@events.handler("rej.#", bind=True)
def rej(event):
    note(event, "rej", deaths=[(d["queue"], d["reason"]) for d in event.headers.get("x-death", [])])
"""


def test_a_message_rejected_elsewhere_comes_back_through_the_ladder_counted(make_project):
    """basic.reject(requeue=False) by any consumer: the queue's dead-letter arguments send it one
    unit through the ladder, back to the same queue only, and the reject counts as an attempt."""
    from kombu import Connection

    project = make_project(REJECTED)
    project.declare()
    queue = f"{project.service}.rej"
    message_id = send(project, "rej.1", {"n": 1}, application_headers={"x-request-id": "r-7"})
    with Connection(project.broker_url) as conn:
        channel = conn.channel()
        message = wait_for(lambda: channel.basic_get(queue, no_ack=False), what="the message")
        channel.basic_reject(message.delivery_tag, requeue=False)
        rejected_at = time.time()
    wait_for(lambda: queue_depth(project.broker_url, queue)[0] == 1, timeout=5, what="back in its queue")
    assert time.time() - rejected_at >= 0.1 - EPSILON  # it waited one 100 ms unit in the ladder
    project.worker().wait_ready()
    [call] = wait_for(lambda: calls(project, "rej"), what="handled")
    assert call["message_id"] == message_id
    assert call["attempt"] == 2  # the reject counted
    assert call["routing_key"] == "rej.1"  # the event's own key, not the ladder's
    # The broker's own record: rejected from its queue, expired from ladder level 0.
    assert sorted(map(tuple, call["deaths"])) == [(f"{project.service}.delay.0", "expired"), (queue, "rejected")]
    assert call["headers"]["x-request-id"] == "r-7"


QUORUM = f"""
app.conf.task_default_queue_type = "quorum"  # a classic task queue would stop the worker on a cluster
events = Events(app, service=SERVICE, exchange=EXCHANGE, {SETTINGS}, backoff={BACKOFF}, queue_type="quorum",
                max_retries=1)

@events.handler("qq.#", bind=True)
def qq(event):
    note(event, "qq")
    if event.payload.get("fail") or event.attempt == 1:
        raise RuntimeError("fails")
"""


@pytest.fixture
def vhost_project(tmp_path, broker_url):
    """``vhost_project(body)``: a Project on a vhost of its own, deleted afterwards with all it holds
    (Celery's native delayed delivery declares queues of its own once its queues are quorum)."""
    with temporary_vhost(broker_url) as url:
        projects: list[Project] = []

        def make(body: str) -> Project:
            directory = tmp_path / f"p{len(projects)}"
            directory.mkdir()
            projects.append(Project(directory, url, PRELUDE + body))
            return projects[-1]

        try:
            yield make
        finally:
            for project in projects:
                for worker in project.workers:
                    worker.kill()


def test_quorum_queues_retry_and_archive_the_same_way(vhost_project):
    project = vhost_project(QUORUM)
    project.worker().wait_ready()
    queue = f"{project.service}.qq"
    info = management_queue(project.broker_url, queue)
    assert info["type"] == "quorum"
    assert info["arguments"]["x-dead-letter-strategy"] == "at-least-once"
    assert info["arguments"]["x-overflow"] == "reject-publish"
    assert management_queue(project.broker_url, f"{project.service}.delay.0")["type"] == "quorum"
    once, always = send(project, "qq.1", {}), send(project, "qq.2", {"fail": True})
    wait_for(lambda: len(calls(project, "qq", once)) == 2, what="retried once, then handled")
    [archived] = wait_archived(project)
    assert archived.properties["message_id"] == always
    assert [c["attempt"] for c in calls(project, "qq", always)] == [1, 2]
