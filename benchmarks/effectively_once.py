"""Effectively once, measured: ``python -m benchmarks.effectively_once [--n 2000] [--reps 3]``.

Two comparisons on the PostgreSQL at ``$KOMBU_EVENTS_TEST_PGHOST`` (127.0.0.1), through
SQLAlchemy, in one run with repetitions interleaved:

- **once vs plain**: a real ``celery worker --with-events-step --pool=solo`` drains N events
  into a handler that inserts one row; ``once=True`` (the insert joins the inbox's
  transaction with the inbox row) vs the same handler without it (the insert in a
  transaction of its own). Rate = (N - 1) / (last row's time - first row's time), from the
  rows the handler wrote: worker start-up is not measured.
- **outbox vs direct**: N events published one by one; ``direct``: ``events.publish``
  (confirmed); ``outbox``: one transaction per event (an insert of the application's own
  plus ``events.publish(..., using=session)``) and the relay draining the outbox (pipelined
  confirms, batches of 100): the caller's rate, and the end-to-end rate until the broker
  holds all N (counted in a queue bound for them).

Prints a Markdown table; every name it creates starts with ``kebench-`` and is deleted.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid
from pathlib import Path
from typing import Callable, TypeVar

import psycopg
import sqlalchemy as sa
from celery import Celery
from kombu import Connection, Exchange, Queue
from sqlalchemy.orm import Session

from kombu_events import BrokerUnavailableError, Events
from kombu_events.database import Relay, status
from kombu_events.database.tables import metadata

T = TypeVar("T")
ROOT = Path(__file__).resolve().parents[1]
HOST = os.environ.get("KOMBU_EVENTS_TEST_PGHOST", "127.0.0.1")

APP = '''
import time
import sqlalchemy as sa
from celery import Celery
from kombu_events import Events
from kombu_events.database import session

app = Celery("kebench-once", broker={broker!r})
app.conf.task_default_queue = {service!r} + ".tasks"
engine = sa.create_engine({url!r}, pool_size=2)
rows = sa.Table("bench_rows", sa.MetaData(), sa.Column("id", sa.Integer, primary_key=True),
                sa.Column("i", sa.Integer), sa.Column("t", sa.Float))
events = Events(app, service={service!r}, exchange={exchange!r}, database=engine)

@events.handler("bench.once", once=True)
def once(payload):
    session().execute(rows.insert().values(i=payload["i"], t=time.time()))

@events.handler("bench.plain")
def plain(payload):
    with engine.begin() as connection:
        connection.execute(rows.insert().values(i=payload["i"], t=time.time()))
'''


def _database(admin: psycopg.Connection) -> tuple[str, str]:
    name = f"kebench_{uuid.uuid4().hex[:10]}"
    admin.execute(f'CREATE DATABASE "{name}"')
    return name, f"postgresql+psycopg://postgres@{HOST}:5432/{name}"


def consume(kind: str, n: int, broker: str, url: str, engine: sa.Engine, workdir: Path) -> float:
    """Rate of one drain of ``n`` events into the ``kind`` handler (a fresh worker each time)."""
    service, exchange = f"kebench-{uuid.uuid4().hex[:8]}", f"kebench-{uuid.uuid4().hex[:8]}"
    module = f"once_app_{uuid.uuid4().hex[:8]}"
    (workdir / f"{module}.py").write_text(textwrap.dedent(APP.format(broker=broker, service=service,
                                                                     exchange=exchange, url=url)))
    with engine.begin() as c:
        c.execute(sa.text("TRUNCATE bench_rows, kombu_events_inbox"))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(workdir), str(ROOT)])}
    log = open(workdir / f"{module}.log", "w")  # noqa: SIM115 -- closed below
    worker = subprocess.Popen([sys.executable, "-m", "celery", "-A", module, "worker", "--pool=solo",
                               "--without-mingle", "--without-gossip", "--without-heartbeat", "-l", "WARNING",
                               "--with-events-step", f"--hostname={module}@%h"], cwd=workdir, env=env,
                              stdout=log, stderr=subprocess.STDOUT)
    try:
        sys.path.insert(0, str(workdir))
        publisher = Events(Celery(broker=broker, set_as_current=False), service=f"{service}-pub", exchange=exchange)
        deadline = time.monotonic() + 60
        while True:  # the worker declared its queues once a publish is routable
            try:
                publisher.publish(f"bench.{kind}", {"i": -1})
                break
            except Exception:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        for first in range(0, n, 1000):
            publisher.publish_many([(f"bench.{kind}", {"i": i}) for i in range(first, min(n, first + 1000))])
        deadline = time.monotonic() + 300
        while True:
            with engine.connect() as c:
                count, first_t, last_t = c.execute(sa.text(
                    "SELECT COUNT(*), MIN(t), MAX(t) FROM bench_rows WHERE i >= 0")).one()
            if count >= n:
                break
            if time.monotonic() > deadline or worker.poll() is not None:
                raise RuntimeError(f"{kind}: {count} of {n} handled; see {log.name}")
            time.sleep(0.2)
        assert count == n, f"{kind}: {count} rows for {n} events"
        return (n - 1) / (last_t - first_t)
    finally:
        worker.terminate()
        worker.wait(30)
        log.close()
        with Connection(broker) as conn:
            channel = conn.default_channel
            for name in (f"{service}.once", f"{service}.plain"):
                channel.queue_delete(name)
            for exchange_name in (exchange, f"{service}.delivery", f"{service}.archive"):
                channel.exchange_delete(exchange_name)
            channel.queue_delete(f"{service}.archive")
            channel.queue_delete(f"{service}.tasks")
            channel.exchange_delete(f"{service}.tasks")
            for level in range(16):
                channel.queue_delete(f"{service}.delay.{level}")
                channel.exchange_delete(f"{service}.delay.{level}")


def publish(kind: str, n: int, broker: str, engine: sa.Engine) -> tuple[float, float]:
    """(caller's rate, rate until the broker holds all ``n``) for ``direct`` or ``outbox`` publishing."""
    exchange = f"kebench-{uuid.uuid4().hex[:8]}"
    app = Celery(broker=broker, set_as_current=False)
    events = Events(app, service=f"{exchange}-svc", exchange=exchange, database=engine, outbox=True)
    sink = Queue(f"{exchange}.sink", Exchange(exchange, "topic", durable=True), "bench.#")
    placed = sa.Table("bench_rows", sa.MetaData(), sa.Column("id", sa.Integer, primary_key=True),
                      sa.Column("i", sa.Integer), sa.Column("t", sa.Float))
    with Connection(broker) as conn:
        sink(conn.default_channel).declare()
    try:
        events.publish("bench.warm", {"i": -1})
        start = time.perf_counter()
        for i in range(n):
            if kind == "direct":
                events.publish("bench.x", {"i": i})
            else:
                with Session(engine) as s, s.begin():
                    s.execute(placed.insert().values(i=i, t=time.time()))
                    events.publish("bench.x", {"i": i}, using=s)
        caller = time.perf_counter() - start
        if kind == "outbox":
            relay = Relay(events.database, events.publishing)
            while relay.run_once():
                pass
            assert status(events.database).depth == 0
        total = time.perf_counter() - start
        with Connection(broker) as conn:
            _, held, _ = sink(conn.default_channel).queue_declare(passive=True)
        assert held == n + 1, f"{kind}: the broker holds {held} of {n + 1}"
        return n / caller, n / total
    finally:
        events.publishing.publisher.close() if hasattr(events.publishing.publisher, "close") else None
        with Connection(broker) as conn:
            conn.default_channel.queue_delete(sink.name)
            conn.default_channel.exchange_delete(exchange)


def _again(run: Callable[[], T]) -> T:
    """``run()``, once more if the broker dropped the connection (other tests share it): a run either
    completes with exact counts or is not reported."""
    for attempt in range(3):
        try:
            return run()
        except BrokerUnavailableError as exc:
            print(f"run lost its broker connection ({exc}); running it again", file=sys.stderr)
            if attempt == 2:
                raise
    raise AssertionError("unreachable")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=2000)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--broker", default=os.environ.get("KEB_BROKER_URL", "amqp://guest:guest@127.0.0.1:5672//"))
    args = parser.parse_args()
    admin = psycopg.connect(dbname="postgres", user="postgres", host=HOST, autocommit=True)
    name, url = _database(admin)
    engine = sa.create_engine(url)
    results: dict[str, list[float]] = {}
    try:
        metadata.create_all(engine)
        sa.Table("bench_rows", sa.MetaData(), sa.Column("id", sa.Integer, primary_key=True),
                 sa.Column("i", sa.Integer), sa.Column("t", sa.Float)).create(engine)
        with tempfile.TemporaryDirectory(prefix="kebench-once-") as tmp:
            for _rep in range(args.reps):  # interleaved: each comparison's rows share the machine's state
                for kind in ("once", "plain"):
                    results.setdefault(f"handler-{kind}", []).append(
                        consume(kind, args.n, args.broker, url, engine, Path(tmp)))
                for kind in ("direct", "outbox"):
                    caller, end_to_end = _again(lambda kind=kind: publish(kind, args.n, args.broker, engine))
                    results.setdefault(f"pub-{kind}", []).append(caller)
                    if kind == "outbox":
                        results.setdefault("pub-outbox-relayed", []).append(end_to_end)
    finally:
        engine.dispose()
        admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.close()
    median = {key: statistics.median(values) for key, values in results.items()}
    baseline = {"handler-once": "handler-plain", "pub-outbox": "pub-direct", "pub-outbox-relayed": "pub-direct"}
    print(f"\nN = {args.n}, {args.reps} repetitions, interleaved; PostgreSQL {HOST} through SQLAlchemy\n")
    print("| row | msgs/s (median) | min \u2013 max | vs |")
    print("|---|---|---|---|")
    for key, values in results.items():
        versus = f"{median[key] / median[baseline[key]]:.2f}\u00d7 `{baseline[key]}`" if key in baseline else ""
        print(f"| `{key}` | {median[key]:,.0f} | {min(values):,.0f} \u2013 {max(values):,.0f} | {versus} |")


if __name__ == "__main__":
    main()
