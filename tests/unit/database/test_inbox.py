"""The inbox: dedup keys, the Handled skip in Hooks.around, registration checks, the transaction on SQLite."""
from __future__ import annotations

import hashlib

import pytest
import sqlalchemy as sa
from celery import Celery

from kombu_events import Events, Retry
from kombu_events.core.event import Event
from kombu_events.database import Inbox, backend_for, session
from kombu_events.database.inbox import prune
from kombu_events.database.schema import dedup_key
from kombu_events.database.tables import metadata
from kombu_events.errors import Archive, ConfigurationError
from kombu_events.middleware.base import Handled, Hooks, Middleware


def _event(queue="svc.h", message_id="m1", body=b'{"a":1}', routing_key="orders.created"):
    properties = {"message_id": message_id} if message_id else {}
    return Event({"a": 1}, routing_key, queue, 1, {}, properties, body)


def test_the_key_is_the_message_id_else_a_hash_of_routing_key_and_body_else_the_callables():
    assert dedup_key(True, _event()) == "m1"
    expected = "sha256:" + hashlib.sha256(b"orders.created\0" + b'{"a":1}').hexdigest()
    assert dedup_key(True, _event(message_id=None)) == expected
    assert dedup_key(True, _event(message_id=None, routing_key="orders.other")) != expected
    assert dedup_key(lambda e: f"order-{e.payload['a']}", _event()) == "order-1"
    with pytest.raises(ConfigurationError, match="must return a non-empty string"):
        dedup_key(lambda e: "", _event())


@pytest.fixture
def engine(tmp_path):
    engine = sa.create_engine(f"sqlite:///{tmp_path / 'db.sqlite3'}")
    metadata.create_all(engine)
    sa.Table("effects", sa.MetaData(), sa.Column("key", sa.String(20))).create(engine)
    yield engine
    engine.dispose()


def _inbox(engine):
    return Inbox(backend_for(engine), lambda: {"svc.h": True})


def _effects(engine):
    with engine.connect() as c:
        return [r[0] for r in c.execute(sa.text("SELECT key FROM effects"))]


def _write(key):
    def call():
        session().execute(sa.text("INSERT INTO effects (key) VALUES (:k)"), {"k": key})
        return 0.0
    return call


def test_a_committed_key_skips_the_handler_and_a_raise_rolls_both_back(engine):
    hooks = Hooks([_inbox(engine)])
    with pytest.raises(RuntimeError):
        hooks.around(_event(), lambda: (_write("a")(), (_ for _ in ()).throw(RuntimeError("boom"))))
    assert _effects(engine) == []  # the handler's write and the inbox row rolled back together
    hooks.around(_event(), _write("a"))
    called = []
    assert hooks.around(_event(), lambda: called.append(1), skipped=lambda: "skipped") == "skipped"
    assert called == [] and _effects(engine) == ["a"]
    with pytest.raises(RuntimeError, match="only available inside a once=True handler"):
        hooks.around(_event(queue="svc.other"), _write("b"))  # not a once queue: no transaction of ours


def test_a_database_that_fails_retries_the_message_instead_of_running_the_handler(tmp_path):
    engine = sa.create_engine(f"sqlite:///{tmp_path / 'empty.sqlite3'}")  # no inbox table
    with pytest.raises(Retry, match="inserting its inbox row failed"):
        Hooks([_inbox(engine)]).around(_event(), lambda: pytest.fail("the handler ran without its inbox row"))


def test_a_key_function_that_raises_archives_rather_than_running_without_a_key(engine):
    inbox = Inbox(backend_for(engine), lambda: {"svc.h": lambda event: event.payload["missing"]})
    with pytest.raises(Archive, match="no inbox key"):
        Hooks([inbox]).around(_event(), lambda: pytest.fail("ran"))


def test_handled_from_a_context_leaves_the_outer_contexts_cleanly():
    seen = []

    class Outer(Middleware):
        def handling(self, event):
            from contextlib import contextmanager

            @contextmanager
            def context():
                seen.append("in")
                yield
                seen.append("out")
            return context()

    class Skip(Middleware):
        def handling(self, event):
            raise Handled("k")

    assert Hooks([Outer(), Skip()]).around(_event(), lambda: pytest.fail("ran"), skipped=lambda: 7) == 7
    assert seen == ["in", "out"]


def test_rows_older_than_the_retention_are_pruned(engine):
    backend = backend_for(engine)
    Hooks([_inbox(engine)]).around(_event(), _write("a"))
    assert prune(backend, older_than_s=3600) == 0
    assert prune(backend, older_than_s=1, now=10**12) == 1


def test_once_needs_a_database_and_refuses_async_handlers():
    app = Celery("t", broker="memory://", set_as_current=False)
    events = Events(app, service="once-svc")
    with pytest.raises(ConfigurationError, match="once= needs Events"):
        events.handler("a.b", once=True)(lambda payload: None)
    with pytest.raises(ConfigurationError, match="once must be True, False or a function"):
        events.handler("a.b", once="yes")
    with pytest.raises(ConfigurationError, match="outbox=True needs database"):
        Events(app, service="once-svc2", outbox=True)
    engine = sa.create_engine("sqlite://")
    events = Events(app, service="once-svc3", database=engine)

    async def handler(payload):
        pass

    with pytest.raises(ConfigurationError, match="async def function with once=True"):
        events.handler("a.b", once=True)(handler)
    with pytest.raises(ConfigurationError, match="database must be 'django'"):
        Events(app, service="once-svc4", database="postgres://x")
