"""``-A``: a Celery app (its one service, or ``--service``), or an ``Events`` itself (``-A module:events``)."""
from __future__ import annotations

import sys
import textwrap
import uuid

import pytest

from kombu_events.cli.common import Context
from kombu_events.errors import KombuEventsError

MODULE = """
from celery import Celery
from kombu_events import Events

app = Celery("selection", broker="amqp://guest:guest@127.0.0.1:5672//")
events = Events(app, service="billing", exchange="ex")
other_app = Celery("bare", broker="amqp://guest:guest@127.0.0.1:5672//")
"""


@pytest.fixture
def module(tmp_path, monkeypatch) -> str:
    name = f"selection_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(MODULE))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    sys.modules.pop(name, None)


def test_the_events_of_a_module_is_the_service_itself(module):
    events = Context(f"{module}:events", None, None).events
    assert events is sys.modules[module].events
    assert Context(f"{module}:events", None, None).app is sys.modules[module].app, "its app's broker settings"
    assert Context(f"{module}:events", None, "billing").events is events


def test_the_app_finds_its_one_service(module):
    assert Context(f"{module}:app", None, None).events is sys.modules[module].events


def test_a_service_other_than_the_events_given_is_refused(module):
    with pytest.raises(KombuEventsError, match=r"is the Events of service 'billing', not 'shipping'"):
        Context(f"{module}:events", None, "shipping").events


def test_an_app_without_a_service_says_so(module):
    with pytest.raises(KombuEventsError, match=r"registers no Events"):
        Context(f"{module}:other_app", None, None).events
