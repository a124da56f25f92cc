"""Effectively once, killed at the worst moments: Django and SQLAlchemy on PostgreSQL, SQLAlchemy on SQLite.

One project per backend: a ``once=True`` handler that writes one effect row per event
(through the ORM, or ``kombu_events.database.session()``), and ``outbox=True`` so that a
publisher's transaction writes its events to the outbox, relayed by the worker. Real
``celery worker --with-events-step`` processes (solo pool: the handler and the relay run
in the process that is killed) die by SIGKILL three times, each once:

- in the handler, after its write and before the commit (event D);
- after the commit and before the ack, in a ``handler_succeeded`` receiver (event E);
- in the relay after the broker confirmed an outbox row and before its delete (event o1).

A fresh worker follows each death. Then the accounting, by id: every effect exactly once;
the handler of E ran once (its redelivery was acked from the inbox); A published twice
with one ``message_id`` and B twice without one ran once each; C, whose first attempt
raised, left nothing of it; o1 was published exactly twice (the relay died between its
confirm and its delete) and handled once; o2, from a rolled-back transaction, never
published; o3, published outside a transaction, went straight to the broker.
"""
from __future__ import annotations

import json
import os
import sqlite3
import textwrap
from concurrent.futures import ThreadPoolExecutor

import psycopg
import pytest
import sqlalchemy
from kombu import Connection, Exchange, Queue

from kombu_events.database.tables import metadata

from .conftest import POSTGRES
from .harness import publish_amqp, run_cli, unique, wait_for
from .json_schemas import one_document

pytestmark = pytest.mark.integration

COMMON = """
import signal
from kombu_events import signals
from kombu_events.database import relay as _relay

def first_time(name):
    \"\"\"True once per test, across the processes the test kills.\"\"\"
    try:
        os.close(os.open(RECORDS + "." + name, os.O_CREAT | os.O_EXCL))
        return True
    except FileExistsError:
        return False

events = Events(app, service=SERVICE, exchange=EXCHANGE, delay_unit_ms=100, delay_levels=4, max_retries=3,
                backoff=Constant(every_ms=100), database=DATABASE, outbox=True, outbox_poll_interval_ms=50)

@events.handler("orders.#", bind=True, once=True)
def on_order(event):
    p = event.payload
    record(kind="call", id=p["id"], attempt=event.attempt)
    write_effect(p["id"])
    if p.get("fail") and event.attempt == 1:
        raise RuntimeError("the first attempt fails after its write")
    if p.get("crash") == "before_commit" and first_time("before_commit"):
        os.kill(os.getpid(), signal.SIGKILL)

@signals.handler_succeeded.connect(sender=on_order)
def after_commit(sender, event, **kwargs):
    if event.payload.get("crash") == "after_commit" and first_time("after_commit"):
        os.kill(os.getpid(), signal.SIGKILL)

_delete = _relay.delete_published

def crashing_delete(transaction, ids):
    if ids and first_time("relay"):
        os.kill(os.getpid(), signal.SIGKILL)  # the broker confirmed these rows; they are not deleted
    _delete(transaction, ids)

_relay.delete_published = crashing_delete
"""

SQLALCHEMY = """
import sqlalchemy as sa
import sqlalchemy.orm
from kombu_events.database import session

engine = sa.create_engine(DB_URL)
DATABASE = engine
tables = sa.MetaData()
effects = sa.Table("effects", tables, sa.Column("id", sa.Integer, primary_key=True), sa.Column("key", sa.String(50)))
placed = sa.Table("placed", tables, sa.Column("id", sa.Integer, primary_key=True), sa.Column("key", sa.String(50)))

def write_effect(key):
    session().execute(effects.insert().values(key=key))

def place(key, *, commit):
    with sa.orm.Session(engine) as s, s.begin():
        s.execute(placed.insert().values(key=key))
        events.publish("orders." + key, {"id": key}, using=s)
        if not commit:
            raise RuntimeError("rolled back")
"""

DJANGO = """
import django
django.setup()
from django.db import transaction
from things.models import Effect, Placed
DATABASE = "django"

def write_effect(key):
    Effect.objects.create(key=key)

def place(key, *, commit):
    with transaction.atomic():
        Placed.objects.create(key=key)
        events.publish("orders." + key, {"id": key})
        if not commit:
            raise RuntimeError("rolled back")
"""

DJANGO_SETTINGS = """
SECRET_KEY = "test"
USE_TZ = True
INSTALLED_APPS = ["kombu_events.django", "things"]
DEFAULT_AUTO_FIELD = "django.db.models.AutoField"
DATABASES = {{"default": {{"ENGINE": "django.db.backends.postgresql", "NAME": {name!r}, "USER": "postgres",
                           "HOST": {host!r}, "PORT": 5432}}}}
"""

DJANGO_MODELS = """
from django.db import models

class Effect(models.Model):
    key = models.CharField(max_length=50)

class Placed(models.Model):
    key = models.CharField(max_length=50)
"""

PUBLISHER = """
from {module} import place, events
place("o1", commit=True)
try:
    place("o2", commit=False)
except RuntimeError:
    pass
events.publish("orders.o3", {{"id": "o3"}})
"""


@pytest.fixture
def pg_databases(make_database):
    """Two databases of this test's own (Django's, SQLAlchemy's), dropped afterwards (their sessions too)."""
    return [make_database("kev_once_"), make_database("kev_once_")]


def _project(kind, make_project, database, tmp_path):
    """The project of ``kind`` on ``database`` (a PostgreSQL database's name; unused for SQLite); a function
    that runs SQL on its database."""
    if kind == "sqlite":
        path = tmp_path / "app.sqlite3"
        project = make_project(f"DB_URL = {f'sqlite:///{path}'!r}\n" + SQLALCHEMY + COMMON)

        def query(sql):
            with sqlite3.connect(path) as connection:
                return connection.execute(sql).fetchall()
        return project, query
    if kind == "sqlalchemy":
        url = f"postgresql+psycopg://postgres@{POSTGRES['host']}:5432/{database}"
        project = make_project(f"DB_URL = {url!r}\n" + SQLALCHEMY + COMMON)
    else:
        project = make_project(DJANGO + COMMON)
        # This project's processes only: the others must not load Django's connection middleware.
        project.env = lambda env=project.env: {**env(), "DJANGO_SETTINGS_MODULE": "djsettings",
                                               "CELERY_SKIP_CHECKS": "1"}
        (project.dir / "djsettings.py").write_text(DJANGO_SETTINGS.format(name=database, host=POSTGRES["host"]))
        (project.dir / "things").mkdir()
        (project.dir / "things" / "__init__.py").write_text("")
        (project.dir / "things" / "models.py").write_text(textwrap.dedent(DJANGO_MODELS))

    def query(sql):
        with psycopg.connect(dbname=database, autocommit=True, **POSTGRES) as connection:
            cursor = connection.execute(sql)
            return cursor.fetchall() if cursor.description else []
    return project, query


def _create_tables(kind, project, query, database):
    """The inbox and outbox: Django's migrations, the CLI (SQLite), the MetaData (SQLAlchemy on PostgreSQL)."""
    prefix = "things_" if kind == "django" else ""
    for table in ("effect" if kind == "django" else "effects", "placed"):  # the test app's own, by hand
        query(f"CREATE TABLE {prefix}{table} (id {'serial' if kind != 'sqlite' else 'integer'} PRIMARY KEY, "
              "key varchar(50) NOT NULL)")
    if kind == "django":
        result = project.run_python("import django; django.setup(); from django.core.management import "
                                    "call_command; call_command('migrate', 'kombu_events', verbosity=0)")
        assert result.returncode == 0, result.stderr
    elif kind == "sqlite":
        result = run_cli(project, "outbox", "create-tables", "--json")
        assert result.returncode == 0, result.stderr
        assert json.loads(result.stdout)["tables"] == ["kombu_events_inbox", "kombu_events_outbox"]
    else:
        engine = sqlalchemy.create_engine(f"postgresql+psycopg://postgres@{POSTGRES['host']}:5432/{database}")
        metadata.create_all(engine)
        engine.dispose()


KINDS = ("django", "sqlalchemy", "sqlite")


def test_every_effect_once_through_kill_9s(make_project, pg_databases, tmp_path):
    """The three backends at once (each its own project, database and workers): one wall-clock wait for all."""
    databases = dict(zip(("django", "sqlalchemy"), pg_databases))
    projects = {kind: _project(kind, make_project, databases.get(kind), tmp_path) for kind in KINDS}
    with ThreadPoolExecutor(len(KINDS)) as pool:
        futures = {kind: pool.submit(_scenario, kind, *projects[kind], databases.get(kind)) for kind in KINDS}
    failures = []
    for kind, future in futures.items():
        try:
            future.result()
        except Exception as exc:
            failures.append(f"{kind}: {type(exc).__name__}: {exc}")
    assert not failures, "\n\n".join(failures)


def _scenario(kind, project, query, database):
    _create_tables(kind, project, query, database)
    # Every event the exchange routes, as a subscriber without an inbox would see them.
    tap = Queue(unique("tap"), Exchange(project.exchange, "topic", durable=True), "orders.#", auto_delete=False)
    with Connection(project.broker_url) as connection:
        tap(connection.default_channel).declare()
    try:
        _run(project, query, kind)
        with Connection(project.broker_url) as connection:
            copies = []
            while (message := tap(connection.default_channel).get(no_ack=True)) is not None:
                copies.append(json.loads(message.body)["id"])
    finally:
        with Connection(project.broker_url) as connection:
            tap(connection.default_channel).delete()

    effects = sorted(row[0] for row in query("SELECT key FROM " + ("things_effect" if kind == "django" else "effects")))
    assert effects == ["A", "B", "C", "D", "E", "o1", "o3"], "every effect once, none of o2"
    calls = {}
    for r in project.records(kind="call"):
        calls[r["id"]] = calls.get(r["id"], 0) + 1
    # o1 and o3 are handled while the relay may be killed (one process): a handler in flight then runs again.
    assert {k: v for k, v in calls.items() if k in "ABCDE"} == {"A": 1, "B": 1, "C": 2, "D": 2, "E": 1}
    assert calls["o1"] in (1, 2) and calls["o3"] in (1, 2)
    assert sorted(copies) == ["A", "A", "B", "B", "C", "D", "E", "o1", "o1", "o3"], \
        "o1 published twice (the relay died between its confirm and its delete), o2 never"
    assert query("SELECT COUNT(*) FROM kombu_events_inbox") == [(7,)]
    assert query("SELECT COUNT(*) FROM kombu_events_outbox") == [(0,)]
    placed = sorted(row[0] for row in query("SELECT key FROM " + ("things_placed" if kind == "django" else "placed")))
    assert placed == ["o1"]
    assert all(os.path.exists(f"{project.records_path}.{mark}") for mark in ("before_commit", "after_commit", "relay"))
    if kind == "sqlite":  # the CLI reads the same outbox (one process more: on one backend only)
        result = run_cli(project, "outbox", "status", "--json", "--max-depth", "0")
        assert result.returncode == 0, result.stderr
        document = one_document("outbox-status", result.stdout)
        assert (document["depth"], document["oldest_age_s"], document["failing"]) == (0, None, 0)


def _run(project, query, kind):
    """Publish the handler's events, then the publisher's; start a fresh worker after each death."""
    effects = "things_effect" if kind == "django" else "effects"
    worker = project.worker().wait_ready(timeout=60)

    def send(*events):
        for key, message_id, extra in events:
            properties = {"message_id": message_id} if message_id else {}
            publish_amqp(project.broker_url, project.exchange, f"orders.{key}",
                         json.dumps({"id": key, **extra}).encode(), content_type="application/json", **properties)

    send(("A", "mA", {}), ("A", "mA", {}), ("B", None, {}), ("B", None, {}), ("C", "mC", {"fail": True}))
    # C settled (its retry's confirm, then its ack) before a kill: else the kill redelivers its failed attempt.
    wait_for(lambda: query(f"SELECT COUNT(*) FROM {effects}")[0][0] >= 3, what="A, B and C handled")
    send(("D", "mD", {"crash": "before_commit"}), ("E", "mE", {"crash": "after_commit"}))
    # Done once E's redelivery (after the kill that followed its commit) was acked from the inbox.
    worker = _until(project, worker, lambda w: query(f"SELECT COUNT(*) FROM {effects}")[0][0] >= 5
                    and "event 'mE' was handled before" in w.log, deaths=2)
    result = project.run_python(PUBLISHER.format(module=project.module))
    assert result.returncode == 0, result.stderr
    worker = _until(project, worker, lambda w: query(f"SELECT COUNT(*) FROM {effects}")[0][0] >= 7
                    and query("SELECT COUNT(*) FROM kombu_events_outbox") == [(0,)], deaths=1)
    worker.kill()  # nothing in flight: the accounting follows


def _until(project, worker, done, *, deaths):
    """Wait for ``done()``, starting a fresh worker after each of the ``deaths`` the test app causes."""
    for death in range(deaths + 1):
        wait_for(lambda w=worker: w.proc.poll() is not None or done(w), timeout=60,
                 what="the work done, or the worker killed")
        if worker.proc.poll() is None:
            break
        assert death < deaths, f"the worker died more often than the test kills it:\n{worker.log[-3000:]}"
        worker = project.worker()  # it may die before it says it is ready: its relay runs first
    else:
        raise AssertionError(f"fewer deaths than the {deaths} the test app causes")
    assert worker.proc.poll() is None and done(worker)
    return worker
