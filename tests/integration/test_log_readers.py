"""Readers of logs (``@events.reader``, docs/logs.md) on the real broker: a reader created after the events were
published reads them all in publish order from ``first``; a worker killed -9 mid-read leaves the next one to go
on from the position it wrote (every event handled, the duplicates no more than one write's worth); two
workers never both handle an event; a failing event is retried in place, then archived, and the reader goes on
after it; ``log rewind`` re-runs exactly the events from its offset."""
from __future__ import annotations

import collections
import json

import pytest

from .harness import Project, node_message, run_cli, wait_for

pytestmark = pytest.mark.integration

N = 600

APP = """
import os, signal, time
from datetime import timedelta
from kombu_events import Constant

events = Events(app, service=SERVICE, exchange=EXCHANGE, delay_unit_ms=100, delay_levels=2)
orders = events.log("orders.#", keep=timedelta(days=1))
SLOW_S = 0.0

@events.reader(orders, bind=True, max_retries=2, backoff=Constant(every_ms=50))
def projector(event):
    i = event.payload["i"]
    record(kind="start", i=i, attempt=event.attempt)
    if i in event.payload.get("fail", ()) and event.attempt <= event.payload.get("fails", 1):
        raise RuntimeError(f"event {i} fails on attempt {event.attempt}")
    if SLOW_S:
        time.sleep(SLOW_S)
    record(kind="done", i=i, attempt=event.attempt)
"""


def publish_node(project: Project, payloads: list[dict]) -> None:
    project.node_publish(*(node_message(f"orders.{p['i']}", p) for p in payloads))


def done(project: Project) -> list[int]:
    return [r["i"] for r in project.records(kind="done")]


def cli(project: Project, *args: str):
    result = run_cli(project, *args)
    assert "Traceback" not in result.stderr, result.stderr
    assert result.returncode == 0, f"exit {result.returncode} for {args}:\n{result.stdout}{result.stderr}"
    return result


def test_a_reader_made_after_the_events_reads_them_all_in_order(make_project):
    project = make_project(APP)
    project.declare()
    publish_node(project, [{"i": i} for i in range(N)])  # before any worker: the stream keeps them
    project.worker(pool="prefork", concurrency=2).wait_ready()
    wait_for(lambda: len(done(project)) >= N, timeout=90, what=f"{N} events read")
    assert done(project) == list(range(N))
    wait_for(lambda: (position(project)["position"] or 0) >= N, timeout=10, what="the position written")


def position(project: Project) -> dict:
    result = cli(project, "log", "status", "--json")
    rows = json.loads(result.stdout)
    (reader,) = rows[0]["readers"]
    return reader


def test_a_worker_killed_mid_read_leaves_the_next_to_go_on_from_its_position(make_project):
    project = make_project(APP.replace("SLOW_S = 0.0", "SLOW_S = 0.005"))
    project.declare()
    publish_node(project, [{"i": i} for i in range(N)])
    first = project.worker(pool="prefork", concurrency=2).wait_ready()
    wait_for(lambda: len(done(project)) >= N // 3, timeout=60, what="a third read")
    first.kill()
    before = len(done(project))
    project.worker(pool="prefork", concurrency=2).wait_ready()
    wait_for(lambda: set(done(project)) == set(range(N)), timeout=90, what="every event read")
    handled = done(project)
    counts = collections.Counter(handled)
    again = sorted(i for i, c in counts.items() if c > 1)
    assert all(c <= 2 for c in counts.values())
    assert len(again) <= 100 + 1, f"{len(again)} read again after the kill, more than a write's worth"
    # after the restart, in order from where it went on
    assert handled[before:] == sorted(handled[before:])
    print(f"\n{project.service}: killed after {before} events, {len(again)} read again, all {N} read")


def test_two_workers_never_both_handle_an_event_and_the_standby_takes_over(make_project):
    project = make_project(APP.replace("SLOW_S = 0.0", "SLOW_S = 0.002"))
    project.declare()
    first = project.worker(pool="prefork", concurrency=2).wait_ready()
    wait_for(lambda: position(project)["reading"], timeout=10, what="the first worker holding the reader's lock")
    project.worker(pool="threads", concurrency=2).wait_ready()
    publish_node(project, [{"i": i} for i in range(300)])
    wait_for(lambda: len(done(project)) >= 300, timeout=60, what="300 events read")
    wait_for(lambda: (position(project)["position"] or 0) >= 300, timeout=10, what="the position written")
    assert done(project) == list(range(300))  # each once, in order: the second worker only waited
    first.kill()  # the lock goes with its connection: the standby takes it within its retry interval
    publish_node(project, [{"i": i} for i in range(300, 400)])
    wait_for(lambda: len(done(project)) >= 400, timeout=30, what="100 more events read by the standby")
    assert done(project) == list(range(400))
    records = project.records(kind="done")
    shared = {r["pid"] for r in records[:300]} & {r["pid"] for r in records[300:]}
    assert not shared, "the events after the kill were read by another worker"


def test_a_failing_event_is_retried_in_place_then_archived_and_the_reader_goes_on(make_project):
    project = make_project(APP)
    project.declare()
    publish_node(project, [{"i": i, "fail": [3, 7], "fails": 1 if i == 3 else 9} for i in range(12)])
    project.worker().wait_ready()
    wait_for(lambda: len(done(project)) >= 11, timeout=30, what="11 events read")
    starts = [(r["i"], r["attempt"]) for r in project.records(kind="start")]
    assert starts == [(0, 1), (1, 1), (2, 1), (3, 1), (3, 2), (4, 1), (5, 1), (6, 1), (7, 1), (7, 2), (7, 3),
                      (8, 1), (9, 1), (10, 1), (11, 1)]
    assert done(project) == [i for i in range(12) if i != 7]
    listed = cli(project, "archive", "list", "--json")  # one JSON object per line
    (archived,) = [json.loads(line) for line in listed.stdout.splitlines() if line.strip()]
    assert archived["queue"] == f"{project.service}.reader.projector", archived
    kept = run_cli(project, "archive", "replay", "--queue", f"{project.service}.reader.projector")
    assert kept.returncode == 1 and "is a reader of a log" in kept.stdout + kept.stderr, kept.stdout + kept.stderr
    assert len(cli(project, "archive", "list", "--json").stdout.splitlines()) == 1, "kept in the archive"


def test_a_rewind_re_runs_exactly_the_events_from_its_offset(make_project):
    project = make_project(APP)
    project.declare()
    publish_node(project, [{"i": i} for i in range(200)])
    project.worker().wait_ready()
    wait_for(lambda: len(done(project)) >= 200, timeout=60, what="200 events read")
    offsets = stream_offsets(project)
    result = cli(project, "log", "rewind", "projector", "--to", str(offsets[150]), "--yes")
    assert "50 event(s)" in result.stdout, result.stdout
    wait_for(lambda: len(done(project)) >= 250, timeout=30, what="the 50 events from the rewind")
    assert done(project)[200:] == list(range(150, 200))


BEHIND = """
from kombu_events import Constant

events = Events(app, service=SERVICE, exchange=EXCHANGE, delay_unit_ms=100, delay_levels=2)
bulk = events.log("bulk.#", max_bytes=2 * 2**20)

@events.reader(bulk, bind=True)
def projector(event):
    record(kind="done", i=event.payload["i"], offset=event.headers["x-stream-offset"])
"""


def test_a_reader_behind_retention_goes_on_from_the_first_event_kept(make_project):
    """A reader stopped while retention removed the events after its position: the next worker goes on from the
    log's first event, in order, to the last; ``log status`` counts its lag from there and says so."""
    project = make_project(BEHIND)
    project.declare()
    publish = ("from {m} import events\nfor i in range({a}, {b}):\n"
               "    events.publish('bulk.%d' % i, {{'i': i, 'pad': 'x' * {pad}}})")
    assert project.run_python(publish.format(m=project.module, a=0, b=2, pad=10)).returncode == 0
    worker = project.worker().wait_ready()
    wait_for(lambda: len(done(project)) >= 2, timeout=30, what="the first 2 events read")
    worker.stop()
    assert reader_row(project)["position"] == 2
    # 64 KiB each, confirmed one at a time (a chunk each): segments of 1 MiB, the oldest removed past 2 MiB
    result = project.run_python(publish.format(m=project.module, a=2, b=66, pad=65536))
    assert result.returncode == 0, result.stderr
    [log] = json.loads(cli(project, "log", "status", "--json").stdout)
    first = log["first"]["offset"]
    assert first > 2, "retention removed the events after the reader's position"
    assert log["readers"][0]["lag"] == log["last"]["offset"] + 1 - first, "the lag counts what is left to read"
    text = cli(project, "log", "status").stdout
    assert f"position 2, lag {log['readers'][0]['lag']} (the log now starts at offset {first}: any event " in text
    project.worker().wait_ready()
    wait_for(lambda: done(project)[-1:] == [65], timeout=60, what="the reader at the last event")
    records = project.records(kind="done")
    after = [r["i"] for r in records[2:]]
    assert after == list(range(after[0], 66)) and after[0] > 2, "from the first kept, in order, each once"
    assert records[2]["offset"] == first
    wait_for(lambda: reader_row(project)["lag"] == 0, timeout=10, what="the lag at 0")


def reader_row(project: Project) -> dict:
    [log] = json.loads(cli(project, "log", "status", "--json").stdout)
    return log["readers"][0]


def stream_offsets(project: Project) -> list[int]:
    from kombu import Connection

    from kombu_events.broker.streams import read
    with Connection(project.broker_url) as conn:
        conn.connect()
        return [offset for offset, _ in read(conn.connection, f"{project.service}.log.orders", tail_wait_s=5.0)]


ONCE = """
import sqlalchemy as sa
from datetime import timedelta
from kombu_events.database import session

engine = sa.create_engine(DB_URL)
effects = sa.Table("effects", sa.MetaData(), sa.Column("id", sa.Integer, primary_key=True),
                   sa.Column("i", sa.Integer, nullable=False))

events = Events(app, service=SERVICE, exchange=EXCHANGE, delay_unit_ms=100, delay_levels=2, database=engine)
orders = events.log("orders.#", keep=timedelta(days=1))

@events.reader(orders, bind=True, once=True)
def projector(event):
    session().execute(effects.insert().values(i=event.payload["i"]))
    record(kind="done", i=event.payload["i"])
"""


def test_once_writes_exactly_one_row_per_event_across_three_kills(make_project, effects_database):
    import psycopg

    from .conftest import POSTGRES
    url = effects_database("readers", "id serial PRIMARY KEY, i integer NOT NULL")
    database = url.rsplit("/", 1)[1]
    project = make_project(f"DB_URL = {url!r}\n" + ONCE)
    project.declare()
    n = 3000
    publish_node(project, [{"i": i} for i in range(n)])
    for kill in range(3):  # killed -9 three times mid-read: at a quarter, a half and three quarters
        worker = project.worker(pool="prefork", concurrency=2).wait_ready()
        wait_for(lambda k=kill: len(set(done(project))) >= (k + 1) * n // 4, timeout=90,
                 what=f"{(kill + 1) * n // 4} events read")
        worker.kill()
    project.worker(pool="prefork", concurrency=2).wait_ready()
    wait_for(lambda: set(done(project)) == set(range(n)), timeout=120, what="every event read")

    def rows():
        with psycopg.connect(dbname=database, autocommit=True, **POSTGRES) as connection:
            return [i for (i,) in connection.execute("SELECT i FROM effects ORDER BY id")]
    effects = rows()
    assert len(effects) == n and sorted(effects) == list(range(n)), (len(effects), len(set(effects)))
    assert effects == list(range(n)), "committed in the log's order"
    print(f"\n{project.service}: {n} rows for {n} events after 3 kills -9 (a copy read again after a kill is "
          "dropped by the inbox before its handler runs)")


def test_health_and_the_metrics_see_a_reader_behind_and_one_no_worker_reads(make_project):
    from kombu import Connection
    from prometheus_client import CollectorRegistry

    from kombu_events.integrations.metrics import PrometheusMetrics
    project = make_project(APP)
    project.declare()
    publish_node(project, [{"i": i} for i in range(50)])
    result = run_cli(project, "health", "--max-lag", "10")
    assert result.returncode == 2, result.stdout + result.stderr
    assert "reader projector: no worker reads it" in result.stdout
    project.worker().wait_ready()
    wait_for(lambda: len(done(project)) >= 50, timeout=30, what="50 events read")
    wait_for(lambda: (position(project)["position"] or 0) >= 50, timeout=10, what="the position written")
    assert cli(project, "health", "--max-lag", "10").stdout.startswith("healthy:")
    publish_extra = [{"i": i} for i in range(50, 80)]
    project.workers[0].kill()  # nobody reads the next 30: lag 30
    publish_node(project, publish_extra)
    result = run_cli(project, "health", "--max-lag", "10")
    assert "reader projector: 30 events behind its log, more than --max-lag 10" in result.stdout, result.stdout
    metrics = PrometheusMetrics(CollectorRegistry())
    topology = topology_of(project)
    with Connection(project.broker_url) as conn:
        metrics._read_readers(conn, topology, project.service)
    labels = {"service": project.service, "reader": "projector"}
    assert metrics.registry.get_sample_value("kombu_events_reader_lag", labels) == 30
    assert metrics.registry.get_sample_value("kombu_events_reader_position", labels) == 50


def topology_of(project: Project):
    import importlib
    import sys
    sys.path.insert(0, str(project.dir))
    try:
        return importlib.import_module(project.module).events.topology()
    finally:
        sys.path.remove(str(project.dir))
