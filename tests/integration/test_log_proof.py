"""Issue 38's proof, on each broker: 10,000 events published over a minute by the Node.js publisher, before
any reader exists; then a ``once=True`` reader on PostgreSQL created from ``first``, its worker killed -9 three
times during the read: exactly 10,000 rows, in publish order. Then ``log rewind`` to the 5,000th event's time:
exactly the events from the 5,000th run again, once each, in order. (Retention: test_logs.py.)"""
from __future__ import annotations

import json
import subprocess
import time
from datetime import datetime, timezone

import psycopg
import pytest
from kombu import Connection

from kombu_events.broker.streams import read

from .conftest import POSTGRES
from .harness import NODE_DIR, run_cli, wait_for

pytestmark = pytest.mark.integration

N = 10_000
#: The 5,000th event (index 4999) is the first of its second: a rewind to its time starts exactly there.
REWIND_AT = 4999

APP = """
import sqlalchemy as sa
from datetime import timedelta
from kombu_events.database import session

engine = sa.create_engine(DB_URL)
effects = sa.Table("effects", sa.MetaData(), sa.Column("id", sa.Integer, primary_key=True),
                   sa.Column("i", sa.Integer, nullable=False))

events = Events(app, service=SERVICE, exchange=EXCHANGE, delay_unit_ms=100, delay_levels=2, database=engine)
orders = events.log("orders.#", keep=timedelta(days=1))

@events.reader(orders, once=True)
def projector(payload):
    session().execute(effects.insert().values(i=payload["i"]))
"""


def test_ten_thousand_events_read_once_across_three_kills_then_rewound_to_a_time(make_project, effects_database):
    url = effects_database("logproof", "id serial PRIMARY KEY, i integer NOT NULL")
    database = url.rsplit("/", 1)[1]

    def rows() -> list[int]:
        with psycopg.connect(dbname=database, autocommit=True, **POSTGRES) as connection:
            return [i for (i,) in connection.execute("SELECT i FROM effects ORDER BY id")]

    project = make_project(f"DB_URL = {url!r}\n" + APP)
    project.declare()
    began = time.monotonic()
    subprocess.run(["node", str(NODE_DIR / "publish_paced.js"), project.broker_url, project.exchange, "orders",
                    str(N), "60", str(REWIND_AT)], check=True, capture_output=True, timeout=180, cwd=NODE_DIR)
    published_s = time.monotonic() - began

    began = time.monotonic()
    for kill in (1, 2, 3):  # killed -9 at a quarter, a half and three quarters of the read
        worker = project.worker(pool="prefork", concurrency=2).wait_ready()
        wait_for(lambda k=kill: len(rows()) >= k * N // 4, timeout=120, interval=0.2, what=f"{kill * N // 4} rows")
        worker.kill()
    project.worker(pool="prefork", concurrency=2).wait_ready()
    wait_for(lambda: len(rows()) >= N, timeout=180, interval=0.5, what=f"{N} rows")
    read_s = time.monotonic() - began
    time.sleep(1.5)  # anything read twice would be committed by now
    assert rows() == list(range(N)), "exactly one row per event, in publish order"

    messages = stream(project)
    assert [json.loads(m.body)["i"] for _, m in messages] == list(range(N)), "the log holds them in publish order"
    offset, fifth = messages[REWIND_AT]
    when = utc(fifth.properties["timestamp"]).isoformat()
    assert utc(messages[REWIND_AT - 1][1].properties["timestamp"]) < utc(fifth.properties["timestamp"])
    result = run_cli(project, "log", "rewind", "projector", "--to", when, "--yes", "--json")
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)
    assert (plan["offset"], plan["again"]) == (offset, N - REWIND_AT), plan

    wait_for(lambda: len(rows()) >= 2 * N - REWIND_AT, timeout=120, interval=0.5, what="the rewound events")
    time.sleep(1.5)
    after = rows()
    assert after[N:] == list(range(REWIND_AT, N)), "exactly the events from the 5,000th ran again, once, in order"
    status = json.loads(run_cli(project, "log", "status", "--json").stdout)
    (reader,) = status[0]["readers"]
    wait_for(lambda: reader_position(project) == messages[-1][0] + 1, timeout=10, what="the position written")
    assert reader["generation"] in (0, 1)
    print(f"\n{project.service}: {N} events published in {published_s:.0f} s; read with 3 kills -9 into {N} rows in "
          f"{read_s:.1f} s; rewound to {when} (offset {offset}): {N - REWIND_AT} ran again, {len(after)} rows")


def utc(stamp) -> datetime:
    """A timestamp property as py-amqp gives it: a naive UTC datetime, or seconds."""
    if isinstance(stamp, datetime):
        return stamp.replace(tzinfo=timezone.utc)
    return datetime.fromtimestamp(stamp, tz=timezone.utc)


def reader_position(project):
    (reader,) = json.loads(run_cli(project, "log", "status", "--json").stdout)[0]["readers"]
    return reader["position"] if reader["generation"] == 1 else None


def stream(project):
    with Connection(project.broker_url) as conn:
        conn.connect()
        return list(read(conn.connection, f"{project.service}.log.orders", tail_wait_s=5.0))
