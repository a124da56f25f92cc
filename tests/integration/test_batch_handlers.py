"""Batch handlers (``batch=BatchOf(...)``) in a real ``celery worker --with-events-step`` on RabbitMQ.

1,000 events to a handler of ``max=100``, one in ten failing once through ``BatchFailed``:
every event handled successfully exactly once, the failed ones retried (attempt 2) and acked,
nothing archived, nothing lost, the queues empty. Then ``once=True`` on PostgreSQL: the
worker is killed after a batch's transaction committed and before its acks; the next worker
gets the batch again and the inbox leaves every event of it out: one row per event.
"""
from __future__ import annotations

import collections

import psycopg
import pytest
import sqlalchemy

from kombu_events.database.tables import metadata
from kombu_events.publishing.publisher import Publisher, build_message

from .conftest import POSTGRES
from .harness import queue_counts, wait_for

pytestmark = pytest.mark.integration

N = 1000

APP = """
class Settled(Middleware):
    def settled(self, delivery, outcome, step):  # main process: every settlement, exactly
        record(kind="settled", id=delivery.message_id, action=step.action, attempt=delivery.attempt)

events = Events(app, service=SERVICE, exchange=EXCHANGE, delay_unit_ms=100, delay_levels=6, max_retries=3,
                backoff=Constant(every_ms=200), middleware=[Settled()])

@events.handler("orders.#", batch=BatchOf(max=100, wait_ms=50), bind=True)
def store(batch):
    record(kind="call", size=len(batch))
    failed = {i: ValueError("bad sku") for i, event in enumerate(batch)
              if event.payload["id"] % 10 == 0 and event.attempt == 1}
    for i, event in enumerate(batch):
        if i not in failed:
            record(kind="handled", id=event.payload["id"], attempt=event.attempt)
    if failed:
        raise BatchFailed(failed)
"""


def publish(broker_url, exchange, ids, prefix="id"):
    publisher = Publisher(broker_url)
    try:
        items = [(exchange, f"orders.{i}", build_message({"id": i}, message_id=f"{prefix}-{i}")) for i in ids]
        assert publisher.send_many(items) == [None] * len(items)
    finally:
        publisher.close()


def _left(broker_url, service):
    counts = queue_counts(broker_url)
    return {name: c[:2] for name, c in counts.items() if name.startswith(service + ".") and c[:2] != (0, 0)}


def test_a_thousand_events_in_batches_of_100_the_failed_ones_alone_retried(make_project, broker_url):
    project = make_project("from kombu_events import BatchOf, BatchFailed, Constant\n" + APP)
    project.declare()
    publish(broker_url, project.exchange, range(N))  # waiting before the worker starts: full batches
    project.worker(pool="prefork", concurrency=2).wait_ready()

    def all_acked():
        return len({r["id"] for r in project.records(kind="settled", action="ack")}) == N

    wait_for(all_acked, timeout=90, interval=0.3, what=f"{N} events acked")
    wait_for(lambda: not _left(broker_url, project.service), timeout=20, what="the queues empty")
    settled = collections.defaultdict(list)
    for r in project.records(kind="settled"):
        settled[r["id"]].append((r["action"], r["attempt"]))
    handled = collections.Counter(r["id"] for r in project.records(kind="handled"))
    sizes = [r["size"] for r in project.records(kind="call")]
    assert set(settled) == {f"id-{i}" for i in range(N)}, "nothing lost, nothing settled that was not published"
    for i in range(N):
        expected = [("retry", 1), ("ack", 2)] if i % 10 == 0 else [("ack", 1)]
        assert settled[f"id-{i}"] == expected, (i, settled[f"id-{i}"])
        assert handled[i] == 1, (i, handled[i])
    assert not any(action == "archive" for pairs in settled.values() for action, _ in pairs)
    assert max(sizes) == 100 and sum(sizes) == N + N // 10, sizes
    print(f"\n{project.service}: {N} events in {len(sizes)} calls (largest {max(sizes)}); "
          f"{N // 10} failed once through BatchFailed, retried alone and acked on attempt 2")


ONCE_APP = """
import signal
import sqlalchemy as sa
from kombu_events import BatchOf, signals
from kombu_events.database import session

def first_time(name):
    try:
        os.close(os.open(RECORDS + "." + name, os.O_CREAT | os.O_EXCL))
        return True
    except FileExistsError:
        return False

engine = sa.create_engine(DB_URL)
events = Events(app, service=SERVICE, exchange=EXCHANGE, delay_unit_ms=100, delay_levels=4, max_retries=3,
                database=engine)

@events.handler("orders.#", batch=BatchOf(max=50, wait_ms=100), once=True)
def store(payloads):
    record(kind="call", ids=[p["id"] for p in payloads])
    session().execute(sa.text("INSERT INTO effects (id) VALUES (:id)"), [{"id": p["id"]} for p in payloads])

@signals.handler_succeeded.connect
def die_once_after_the_commit(sender, event=None, **kwargs):
    if event is not None and event.payload["id"] == 7 and first_time("killed"):
        record(kind="killing")
        os.kill(os.getpid(), signal.SIGKILL)  # committed, not acked: the batch is redelivered
"""


def test_once_true_one_transaction_per_batch_one_row_per_event_after_a_redelivery(make_project, make_database,
                                                                                   broker_url):
    database = make_database("kev_batch_")
    url = f"postgresql+psycopg://postgres@{POSTGRES['host']}:5432/{database}"
    engine = sqlalchemy.create_engine(url)
    metadata.create_all(engine)
    engine.dispose()
    with psycopg.connect(dbname=database, autocommit=True, **POSTGRES) as connection:
        connection.execute("CREATE TABLE effects (id integer NOT NULL)")
    project = make_project(f"DB_URL = {url!r}\n" + ONCE_APP)
    project.declare()
    worker = project.worker().wait_ready()
    publish(broker_url, project.exchange, range(200))
    wait_for(lambda: project.records(kind="killing"), timeout=30, what="the worker killed after a commit")
    assert worker.wait_exit(timeout=20) != 0
    project.worker().wait_ready()
    publish(broker_url, project.exchange, range(150, 200))  # published again by their publisher: the same ids
    wait_for(lambda: not _left(broker_url, project.service), timeout=60, interval=0.3, what="the queues empty")
    with psycopg.connect(dbname=database, autocommit=True, **POSTGRES) as connection:
        rows = collections.Counter(r[0] for r in connection.execute("SELECT id FROM effects").fetchall())
        inbox = connection.execute("SELECT count(*) FROM kombu_events_inbox").fetchone()[0]
    assert rows == collections.Counter(range(200)), {i: n for i, n in rows.items() if n != 1}
    assert inbox == 200
    calls = project.records(kind="call")
    assert max(len(c["ids"]) for c in calls) > 1
    called = collections.Counter(i for c in calls for i in c["ids"])
    assert called[7] == 1, "the batch redelivered after the kill was left out of the call (inbox)"
    print(f"\n{project.service}: 200 events in {len(calls)} calls, a kill after a commit, 50 published "
          f"again: one row each")
