"""``registry.EventsService`` against a real ``Events``: every member the protocol names is one of Events', of
the same kind (a property or attribute, or a method), and each method takes what the protocol says it takes.

mypy checks the same where ``Events.__init__`` passes itself to ``registry.register``; this catches a drift
in any run of the unit tests, mypy or not."""
from __future__ import annotations

import inspect

import celery
import pytest

from kombu_events import Events
from kombu_events.registry import EventsService

#: What the protocol names, as declared on it (``_is_protocol`` and the like start with an underscore).
MEMBERS = {name: value for name, value in vars(EventsService).items() if not name.startswith("_")}
PROPERTIES = sorted(name for name, value in MEMBERS.items() if isinstance(value, property))
METHODS = sorted(name for name, value in MEMBERS.items() if inspect.isfunction(value))
MISSING = object()


@pytest.fixture
def events() -> Events:
    events = Events(celery.Celery("proj", broker="memory://", set_as_current=False), service="billing")
    events.handler("orders.#")(lambda payload: None)
    return events


def test_the_protocol_names_properties_and_methods_only():
    assert PROPERTIES and METHODS
    assert sorted(MEMBERS) == sorted(PROPERTIES + METHODS), "a member the checks below would not see"


@pytest.mark.parametrize("name", PROPERTIES)
def test_each_property_is_a_value_of_events(events, name):
    found = inspect.getattr_static(events, name, MISSING)
    assert found is not MISSING, f"Events has no {name!r}"
    assert not inspect.isfunction(found), f"Events.{name} is a method; the protocol reads it as a value"
    getattr(events, name)  # and reading it works on a service with a handler


@pytest.mark.parametrize("name", METHODS)
def test_each_method_of_events_takes_what_the_protocol_passes(name):
    found = inspect.getattr_static(Events, name, None)
    assert inspect.isfunction(found), f"Events.{name} is not a method"
    wanted = list(inspect.signature(MEMBERS[name]).parameters.values())
    given = list(inspect.signature(found).parameters.values())
    assert [(p.name, p.kind) for p in given[:len(wanted)]] == [(p.name, p.kind) for p in wanted], \
        f"Events.{name}{inspect.signature(found)} against EventsService.{name}{inspect.signature(MEMBERS[name])}"
    extra = [p.name for p in given[len(wanted):] if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL,
                                                                                               p.VAR_KEYWORD)]
    assert not extra, f"Events.{name} needs {extra}, which the protocol's callers never pass"
