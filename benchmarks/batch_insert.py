"""Batch handlers, measured: ``python -m benchmarks.batch_insert [--n 20000] [--max 500] [--pool solo]``.

One service, two handlers that insert into PostgreSQL (``$KOMBU_EVENTS_TEST_PGHOST``, 127.0.0.1,
user postgres) through SQLAlchemy, in a table of this run's own database:

- ``one``: one event per call, one transaction with one ``INSERT`` each;
- ``batch``: ``batch=BatchOf(max=500, wait_ms=50)``, one transaction with one ``INSERT`` of the list
  per call (SQLAlchemy's executemany, which sends multi-row INSERTs).

Same run: the topology is declared, N events wait in ``one``'s queue, a real ``celery worker
--with-events-step`` drains them and stops; then the same for ``batch``. Each row keeps the time
its call began; rate = events after the first call's start up to the last call's start, over that
span: worker start-up and publishing are not measured. Prints events/s of each and the ratio
(target: batch >= 10x one). Every name it creates starts with ``kebench-``; all is deleted after.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid
from pathlib import Path
from typing import Any

import psycopg
import sqlalchemy as sa
from celery import Celery
from kombu import Connection

from kombu_events import Events
from kombu_events.broker.declare import declare

from .broker import delete_service

ROOT = Path(__file__).resolve().parents[1]
HOST = os.environ.get("KOMBU_EVENTS_TEST_PGHOST", "127.0.0.1")

APP = '''
import time
import sqlalchemy as sa
from celery import Celery
from kombu_events import BatchOf, Events

app = Celery("kebench-batch", broker={broker!r})
app.conf.task_default_queue = {service!r} + ".tasks"
engine = sa.create_engine({url!r}, pool_size=2)
rows = sa.Table("bench_batch_rows", sa.MetaData(), sa.Column("i", sa.Integer), sa.Column("kind", sa.String(8)),
                sa.Column("t", sa.Float))
events = Events(app, service={service!r}, exchange={exchange!r})

@events.handler("bench.one")
def one(payload):
    started = time.time()
    with engine.begin() as connection:
        connection.execute(rows.insert(), {{"i": payload["i"], "kind": "one", "t": started}})

@events.handler("bench.batch", batch=BatchOf(max={max}, wait_ms=50))
def batch(payloads):
    started = time.time()
    with engine.begin() as connection:
        connection.execute(rows.insert(), [{{"i": p["i"], "kind": "batch", "t": started}} for p in payloads])
'''


def drain(kind: str, n: int, module: str, workdir: Path, engine: sa.Engine, pool: str, concurrency: int) -> float:
    """Publish ``n`` events for ``kind``, then let a fresh worker drain them; events/s of its calls."""
    events = __import__(module).events
    publisher = Events(Celery(broker=events.broker_url, set_as_current=False), service=f"{events.service}-pub",
                       exchange=events.settings.exchange)
    for first in range(0, n, 1000):
        publisher.publish_many([(f"bench.{kind}", {"i": i}) for i in range(first, min(n, first + 1000))])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(workdir), str(ROOT)])}
    with open(workdir / f"{module}.{kind}.log", "w") as log:
        worker = subprocess.Popen([sys.executable, "-m", "celery", "-A", module, "worker", f"--pool={pool}",
                                   f"--concurrency={concurrency}",
                                   "--without-mingle", "--without-gossip", "--without-heartbeat", "-l", "WARNING",
                                   "--with-events-step", f"--hostname={module}-{kind}@%h"], cwd=workdir, env=env,
                                  stdout=log, stderr=subprocess.STDOUT)
        try:
            return _rate(kind, n, engine, worker, log.name)
        finally:
            worker.terminate()
            worker.wait(30)


def _rate(kind: str, n: int, engine: sa.Engine, worker: subprocess.Popen[bytes], log: str) -> float:
    deadline = time.monotonic() + 600
    query = sa.text("SELECT t, COUNT(*) FROM bench_batch_rows WHERE kind = :kind GROUP BY t ORDER BY t")
    while True:
        with engine.connect() as c:
            calls = c.execute(query, {"kind": kind}).all()
        if sum(count for _, count in calls) >= n:
            break
        if time.monotonic() > deadline or worker.poll() is not None:
            raise RuntimeError(f"{kind}: {sum(count for _, count in calls)} of {n} handled; see {log}")
        time.sleep(0.2)
    assert sum(count for _, count in calls) == n, f"{kind}: more rows than events"
    return (n - calls[-1][1]) / (calls[-1][0] - calls[0][0])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--n", type=int, default=20_000)
    parser.add_argument("--max", type=int, default=500)
    parser.add_argument("--pool", default="solo")
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--broker", default=os.environ.get("KEB_BROKER_URL", "amqp://guest:guest@127.0.0.1:5672//"))
    args = parser.parse_args(argv)
    admin = psycopg.connect(dbname="postgres", user="postgres", host=HOST, autocommit=True)
    database = f"kebench_{uuid.uuid4().hex[:10]}"
    admin.execute(f'CREATE DATABASE "{database}"')
    url = f"postgresql+psycopg://postgres@{HOST}:5432/{database}"
    engine = sa.create_engine(url)
    service, exchange = f"kebench-{uuid.uuid4().hex[:8]}", f"kebench-{uuid.uuid4().hex[:8]}"
    module = f"batch_app_{uuid.uuid4().hex[:8]}"
    rates: dict[str, float] = {}
    topologies: list[Any] = []
    try:
        with engine.begin() as c:
            c.execute(sa.text("CREATE TABLE bench_batch_rows (i integer, kind varchar(8), t double precision)"))
        with tempfile.TemporaryDirectory(prefix="kebench-batch-") as tmp:
            workdir = Path(tmp)
            (workdir / f"{module}.py").write_text(textwrap.dedent(APP.format(
                broker=args.broker, service=service, exchange=exchange, url=url, max=args.max)))
            sys.path.insert(0, str(workdir))
            events = __import__(module).events
            topologies.append(events.topology())
            topologies.append(Events(Celery(broker=args.broker, set_as_current=False), service=f"{service}-pub",
                                     exchange=exchange).topology())
            with Connection(args.broker) as conn:
                declare(topologies[0], conn)
            for kind in ("one", "batch"):
                rates[kind] = drain(kind, args.n, module, workdir, engine, args.pool, args.concurrency)
    finally:
        delete_service(args.broker, topologies, service)
        engine.dispose()
        admin.execute(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)')
        admin.close()
    print(f"\nN = {args.n} per handler, --pool={args.pool} --concurrency={args.concurrency}, "
          f"PostgreSQL {HOST} through SQLAlchemy\n")
    print("| handler | events/s |\n|---|---|")
    print(f"| one event per call | {rates['one']:,.0f} |")
    print(f"| `batch=BatchOf(max={args.max}, wait_ms=50)` | {rates['batch']:,.0f} |")
    print(f"\nratio: {rates['batch'] / rates['one']:.1f}x (target >= 10x)")


if __name__ == "__main__":
    main()
