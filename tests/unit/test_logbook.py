"""Registering readers (logbook.py, ``@events.reader``): refused at import time with an error that says what fits;
a reader is never among the handlers, its route is, with prefetch 1, and once=True needs a database."""
from __future__ import annotations

from datetime import timedelta

import celery
import pytest

from kombu_events import Events
from kombu_events.core.readers import reader_key
from kombu_events.errors import ConfigurationError


@pytest.fixture
def events():
    return Events(celery.Celery("t", broker="memory://"), service="shop")


def project(payload):
    return payload


def test_a_reader_is_a_route_and_never_a_handler(events):
    orders = events.log("orders.#", keep=timedelta(days=1))
    events.reader(orders, start="last")(project)
    assert events.handlers == ()
    (handler,) = events.readers
    assert (handler.queue, handler.prefetch, handler.reader.start, handler.once) == ("shop.reader.project", 1, "last",
                                                                                     False)
    assert [r.handler.queue for r in events.routes()] == ["shop.reader.project"]
    assert [r.name for r in events.topology().readers] == ["project"]


@pytest.mark.parametrize("log, options, says", [
    ("orders", {}, r"pass what events\.log"),
    (None, {"start": "middle"}, "start= of a reader"),
    (None, {"once": "yes"}, "once of a reader must be True or False"),
    (None, {"name": "a b"}, "whitespace"),
])
def test_what_a_reader_cannot_do_is_refused_at_import_time(events, log, options, says):
    orders = events.log("orders.#", keep=timedelta(days=1))
    with pytest.raises(ConfigurationError, match=says):
        events.reader(orders if log is None else log, **options)(project)


def test_a_log_of_another_service_and_a_second_reader_of_one_name_are_refused(events):
    other = Events(celery.Celery("u", broker="memory://"), service="billing")
    theirs = other.log("orders.#", keep=timedelta(days=1))
    with pytest.raises(ConfigurationError, match="a log of this service"):
        events.reader(theirs)(project)
    orders = events.log("orders.#", keep=timedelta(days=1))
    events.reader(orders)(project)
    with pytest.raises(ConfigurationError, match="two readers are named 'project'"):
        events.reader(orders)(project)


def test_once_needs_a_database_and_a_def_function(events):
    orders = events.log("orders.#", keep=timedelta(days=1))
    with pytest.raises(ConfigurationError, match="once= needs Events"):
        events.reader(orders, once=True)(project)


def test_once_keys_the_inbox_by_offset_and_generation(tmp_path):
    import sqlalchemy

    events = Events(celery.Celery("t", broker="memory://"), service="shop",
                    database=sqlalchemy.create_engine(f"sqlite:///{tmp_path / 'db.sqlite3'}"))
    orders = events.log("orders.#", keep=timedelta(days=1))

    async def later(payload):
        return payload
    with pytest.raises(ConfigurationError, match="async def"):
        events.reader(orders, once=True)(later)
    events.reader(orders, once=True)(project)
    (handler,) = events.readers
    assert handler.once is reader_key
