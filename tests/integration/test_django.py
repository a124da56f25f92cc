"""Django: a prefork worker's handler keeps writing through the ORM after PostgreSQL dropped its connection.

A real Django project on the machine's PostgreSQL (a database of the test's own,
dropped afterwards). Three events; between the second and the third, the backend
that served the second is terminated with ``pg_terminate_backend``. With the
built-in middleware (``close``, ``max_age``) the third is handled at its first
attempt; with it ``off`` -- what handlers got before -- it fails with "server closed
the connection" and never recovers, which is what shows the test proves the fix.
"""
from __future__ import annotations

import json
import textwrap

import psycopg
import pytest

from .conftest import POSTGRES
from .harness import get_messages, publish_amqp, queue_depth, unique, wait_for

pytestmark = pytest.mark.integration

SETTINGS = """
SECRET_KEY = "test"
USE_TZ = True
INSTALLED_APPS = ["things"]
DEFAULT_AUTO_FIELD = "django.db.models.AutoField"
DATABASES = {{"default": {{
    "ENGINE": "django.db.backends.postgresql", "NAME": {name!r}, "USER": "postgres", "HOST": {host!r},
    "PORT": 5432, "CONN_MAX_AGE": {max_age!r}, "CONN_HEALTH_CHECKS": True,
}}}}
"""

MODELS = """
from django.db import models

class Row(models.Model):
    note = models.TextField()
"""

PROJECT = """
import django
django.setup()
from django.db import connection
from things.models import Row

events = Events(app, service=SERVICE, exchange=EXCHANGE, delay_unit_ms=100, delay_levels=4, max_retries=1,
                django_connections=MODE)

@events.handler("rows.#", bind=True)
def write(event):
    try:
        Row.objects.create(note=event.payload["note"])
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_backend_pid()")
            backend = cursor.fetchone()[0]
    except Exception as exc:
        record(note=event.payload["note"], attempt=event.attempt, error=f"{type(exc).__name__}: {exc}")
        raise
    record(note=event.payload["note"], attempt=event.attempt, backend=backend)
"""


@pytest.fixture
def database(make_database):
    """A database of this test's own with the project's table, dropped afterwards (its sessions too)."""
    name = make_database("kev_django_")
    with psycopg.connect(dbname=name, autocommit=True, **POSTGRES) as connection:
        connection.execute("CREATE TABLE things_row (id serial PRIMARY KEY, note text NOT NULL)")
    return name


def _django_project(make_project, database: str, mode: str, max_age: int | None):
    project = make_project(PROJECT.replace("MODE", repr(mode)))
    (project.dir / "djsettings.py").write_text(SETTINGS.format(name=database, host=POSTGRES["host"], max_age=max_age))
    (project.dir / "things").mkdir()
    (project.dir / "things" / "__init__.py").write_text("")
    (project.dir / "things" / "models.py").write_text(textwrap.dedent(MODELS))
    return project


def _terminate(postgres, backend: int) -> bool:
    """Terminate ``backend`` if it still runs; wait until it is gone. Whether there was one to terminate."""
    terminated = postgres.execute("SELECT pg_terminate_backend(%s)", (backend,)).fetchone()[0]
    wait_for(lambda: not postgres.execute("SELECT 1 FROM pg_stat_activity WHERE pid = %s", (backend,)).fetchall(),
             what=f"backend {backend} gone")
    return bool(terminated)


@pytest.mark.parametrize("mode, max_age", [("close", 0), ("max_age", None), ("off", 0)])
def test_a_handler_recovers_from_a_terminated_database_connection(make_project, database, postgres, monkeypatch,
                                                                   mode, max_age):
    monkeypatch.setenv("DJANGO_SETTINGS_MODULE", "djsettings")  # before the project's Celery app is made
    monkeypatch.setenv("CELERY_SKIP_CHECKS", "1")
    project = _django_project(make_project, database, mode, max_age)
    worker = project.worker(pool="prefork", concurrency=1).wait_ready(timeout=60)

    def send(note: str) -> dict:
        publish_amqp(project.broker_url, project.exchange, f"rows.{note}", json.dumps({"note": note}).encode(),
                     message_id=unique("m"), content_type="application/json")
        return wait_for(lambda: project.records(note=note), what=f"event {note} handled")[0]

    one, two = send("one"), send("two")
    if mode == "close":  # closed once the handler returns: a moment after its record (one CI run was quicker)
        wait_for(lambda: not postgres.execute("SELECT 1 FROM pg_stat_activity WHERE pid = %s",
                                              (two["backend"],)).fetchall(),
                 timeout=10, what="the handler's connection closed after it returned")
    terminated = _terminate(postgres, two["backend"])
    three = send("three")
    if mode == "off":
        wait_for(lambda: len(project.records(note="three")) == 2, what="the retry of event three")
        # The handler records before it raises: the archive copy follows once the main process settles.
        wait_for(lambda: queue_depth(project.broker_url, f"{project.service}.archive")[0] == 1,
                 what="event three archived")
    worker.stop()
    with psycopg.connect(dbname=database, autocommit=True, **POSTGRES) as connection:
        rows = connection.execute("SELECT note FROM things_row ORDER BY id").fetchall()
    archived = get_messages(project.broker_url, f"{project.service}.archive")

    if mode == "close":  # as Celery does for tasks: a connection per handler, closed once it returns
        assert len({one["backend"], two["backend"], three["backend"]}) == 3
        assert not terminated, "the connection was already closed after the handler"
    else:  # the connection outlives the handler
        assert one["backend"] == two["backend"] and terminated
    if mode == "off":
        errors = [r["error"] for r in project.records(note="three")]
        assert "server closed the connection unexpectedly" in errors[0] or "terminating connection" in errors[0]
        assert "closed" in errors[1], "the retry fails too: the dead connection is never replaced"
        assert [m.headers["kombu-events-attempts"] for m in archived] == [2]
        assert rows == [("one",), ("two",)]
    else:
        assert (three["attempt"], "error" in three) == (1, False)
        assert three["backend"] != two["backend"]
        assert rows == [("one",), ("two",), ("three",)] and archived == []
