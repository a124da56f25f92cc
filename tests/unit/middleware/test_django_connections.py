"""middleware/django_connections.py: what is closed around a handler in each mode, with stand-ins for
django.db (no database).
"""
from __future__ import annotations

from types import SimpleNamespace

import celery
import pytest

from kombu_events import Events
from kombu_events.core.event import Event
from kombu_events.middleware.base import Hooks
from kombu_events.middleware.django_connections import DjangoConnections, middleware_for

EVENT = Event({}, "orders.1", "billing.charge", 1)


class DatabaseError(Exception):
    pass


class InterfaceError(DatabaseError):
    pass


class Connection:
    def __init__(self, log, alias, error=None):
        self.log, self.alias, self.error = log, alias, error

    def close(self):
        self.log.append(f"close {self.alias}")
        if self.error is not None:
            raise self.error


def _django(log, *connections):
    handler = SimpleNamespace(all=lambda initialized_only=False: list(connections))
    db = SimpleNamespace(connections=handler, close_old_connections=lambda: log.append("close_old_connections"),
                         DatabaseError=DatabaseError, InterfaceError=InterfaceError)
    cache = SimpleNamespace(close_caches=lambda: log.append("close_caches"))
    return db, cache


def _call(middleware, log, fn=lambda: None):
    def handler():
        log.append("handler")
        fn()
    return Hooks([middleware]).around(EVENT, handler)


def test_close_closes_every_connection_before_and_after_the_handler_then_the_caches():
    log: list[str] = []
    db, cache = _django(log, Connection(log, "default"), Connection(log, "replica"))
    _call(DjangoConnections(lambda: "close", db=db, cache=cache), log)
    assert log == ["close default", "close replica", "handler", "close default", "close replica", "close_caches"]


def test_connections_are_closed_after_a_handler_that_raised_and_its_exception_goes_on():
    log: list[str] = []
    db, cache = _django(log, Connection(log, "default"))
    def boom():
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        _call(DjangoConnections(lambda: "close", db=db, cache=cache), log, fn=boom)
    assert log == ["close default", "handler", "close default", "close_caches"]


def test_max_age_leaves_the_choice_to_djangos_close_old_connections():
    log: list[str] = []
    db, cache = _django(log, Connection(log, "default"))
    _call(DjangoConnections(lambda: "max_age", db=db, cache=cache), log)
    assert log == ["close_old_connections", "handler", "close_old_connections", "close_caches"]


def test_off_touches_nothing_and_the_mode_is_read_once():
    log: list[str] = []
    reads = []
    db, cache = _django(log, Connection(log, "default"))
    middleware = DjangoConnections(lambda: reads.append(1) or "off", db=db, cache=cache)
    _call(middleware, log)
    _call(middleware, log)
    assert log == ["handler", "handler"] and reads == [1]


@pytest.mark.parametrize("error", [InterfaceError("connection already closed"),
                                   DatabaseError("server closed the connection unexpectedly"),
                                   DatabaseError("not connected")])
def test_a_connection_that_is_already_gone_closes_quietly(error):
    log: list[str] = []
    db, cache = _django(log, Connection(log, "default", error), Connection(log, "other"))
    _call(DjangoConnections(lambda: "close", db=db, cache=cache), log)
    assert log.count("close other") == 2 and "handler" in log


def test_another_database_error_is_logged_and_the_handler_still_runs(caplog):
    log: list[str] = []
    db, cache = _django(log, Connection(log, "default", DatabaseError("disk full")))
    _call(DjangoConnections(lambda: "close", db=db, cache=cache), log)
    assert "handler" in log
    assert "failed entering handling()" in caplog.text and "disk full" in caplog.text


@pytest.mark.parametrize("environ, expected", [({}, 0), ({"DJANGO_SETTINGS_MODULE": ""}, 0),
                                               ({"DJANGO_SETTINGS_MODULE": "proj.settings"}, 1)])
def test_only_a_django_project_gets_the_middleware(environ, expected):
    assert len(middleware_for(lambda: "close", environ)) == expected


def test_without_django_installed_it_warns_and_adds_nothing(monkeypatch, caplog):
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    assert middleware_for(lambda: "close", {"DJANGO_SETTINGS_MODULE": "proj.settings"}) == []
    assert "Django is not installed" in caplog.text


def test_events_adds_it_by_itself_last_with_the_services_setting(monkeypatch):
    monkeypatch.setenv("DJANGO_SETTINGS_MODULE", "proj.settings")
    app = celery.Celery("proj", broker="memory://", set_as_current=False)
    app.conf.kombu_events_django_connections = "max_age"
    first = DjangoConnections(lambda: "off")
    events = Events(app, "billing", middleware=[first])
    assert events.hooks.on_handling[0] is first
    builtin = events.hooks.on_handling[1]
    assert isinstance(builtin, DjangoConnections) and builtin._mode() == "max_age"
    monkeypatch.delenv("DJANGO_SETTINGS_MODULE")
    assert Events(app, "other").hooks.on_handling == ()
