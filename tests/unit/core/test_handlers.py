"""core/handlers.py and event.py: binding-key validation, exception classes, runnable handlers, the
Event a handler gets.
"""
from __future__ import annotations

import functools
import inspect
import re
import sys
from unittest import mock

import pytest

from kombu_events.core.event import Event
from kombu_events.core.handlers import (
    awaits,
    check_prefetch,
    check_runnable,
    exception_classes,
    validate_binding_key,
)
from kombu_events.errors import ConfigurationError


@pytest.mark.parametrize("key", ["orders.*.created", "orders.#", "#", "*", "a", "a.b.c", "k" * 255])
def test_valid_binding_keys(key):
    assert validate_binding_key(key) == key


@pytest.mark.parametrize(
    "key, message",
    [
        ("", "non-empty string"),
        (None, "non-empty string"),
        (b"orders.#", "non-empty string"),
        ("orders.*x", "a wildcard must be a whole word"),
        ("ord#ers.created", "a wildcard must be a whole word"),
        ("orders.**", "a wildcard must be a whole word"),
        ("k" * 256, "longer than 255 bytes"),
        ("é" * 128, "longer than 255 bytes"),
    ],
)
def test_invalid_binding_keys(key, message):
    with pytest.raises(ConfigurationError, match=message):
        validate_binding_key(key)


@pytest.mark.parametrize(
    "value, expected",
    [(ValueError, (ValueError,)), ((KeyError, OSError), (KeyError, OSError)), ([KeyError], (KeyError,)),
     ((), ())],
)
def test_exception_classes(value, expected):
    assert exception_classes("retry_for", value) == expected


@pytest.mark.parametrize("value", ["ValueError", ValueError("x"), int, (ValueError, None)])
def test_exception_classes_rejects_other_things(value):
    with pytest.raises(ConfigurationError, match="retry_for must list exception classes"):
        exception_classes("retry_for", value)


def test_event_properties():
    event = Event({"a": 1}, "orders.1.created", "svc.q", 2,
                  properties={"message_id": "m", "correlation_id": "c", "content_type": "application/json",
                              "timestamp": 5})
    assert (event.message_id, event.correlation_id, event.content_type, event.timestamp) == (
        "m", "c", "application/json", 5)
    bare = Event(None, "k", "q", 1)
    assert (bare.message_id, bare.correlation_id, bare.content_type, bare.timestamp) == (None,) * 4
    assert bare.headers == {} and bare.body == b""


@pytest.mark.parametrize("value", [None, 1, 65_535])
def test_check_prefetch_accepts(value):
    assert check_prefetch(value) == value


@pytest.mark.parametrize("value", [0, 65_536, True, 1.0, "1"])
def test_check_prefetch_names_the_valid_range(value):
    with pytest.raises(ConfigurationError, match=r"prefetch must be an integer within 1 \.\. 65535"):
        check_prefetch(value)


# -- check_runnable: what the worker could not run as written is refused at registration ----------


async def on_paid(payload):
    pass


async def streams(payload):
    yield payload


def generates(payload):
    yield payload


class Notifier:
    def __init__(self, payload=None):
        pass


class AsyncNotifier:
    async def __call__(self, payload):
        pass


class SyncNotifier:
    def __call__(self, payload):
        pass


def takes_nothing():
    pass


def takes_two(payload, extra):
    pass


def keyword_only(*, payload):
    pass


MOD = re.escape(__name__)  # the module these functions are defined in, as messages name it
ASYNC_FIX = ("kombu-events awaits async def handlers, not this.*define it with def, "
             "or run the coroutine with asyncio.run inside it")


@pytest.mark.parametrize(
    "fn, message",
    [
        (on_paid, rf"^handler {MOD}\.on_paid is an async def function: {ASYNC_FIX}$"),
        (streams, (rf"^handler {MOD}\.streams is an async generator function: calling it only creates "
                  r"an async generator, so its body would never run; define it with def, without yield$")),
        (generates, (rf"^handler {MOD}\.generates is a generator function: calling it only creates a "
                    r"generator, so its body would never run; define it without yield$")),
        (functools.partial(on_paid), (rf"^handler functools\.partial\({MOD}\.on_paid, \.\.\.\) is a "
                                     rf"functools\.partial of an async def function: {ASYNC_FIX}$")),
        (AsyncNotifier(), (rf"^handler <{MOD}\.AsyncNotifier object> is an object whose __call__ is an "
                          rf"async def function: {ASYNC_FIX}$")),
        (AsyncNotifier().__call__, rf"^handler {MOD}\.AsyncNotifier\.__call__ is an async def function"),
        pytest.param(mock.AsyncMock(), rf"is an async def function: {ASYNC_FIX}$",
                     marks=pytest.mark.skipif(sys.version_info < (3, 10),
                                              reason="inspect sees an AsyncMock as a coroutine function from 3.10")),
        (Notifier, (rf"^handler {MOD}\.Notifier is a class: calling it would only construct an instance "
                   r".*register a function, or an instance whose __call__ takes the event's payload$")),
        (None, r"^handler None is not callable: register a function that takes the event's payload"),
        ("on_paid", r"^handler 'on_paid' is not callable"),
        (takes_nothing, (rf"^handler {MOD}\.takes_nothing\(\) cannot be called with one positional "
                        r"argument \(the event's payload\): every call would fail with TypeError; give it one "
                        r"parameter for it, e\.g\. def takes_nothing\(payload\): \.\.\.$")),
        (takes_two, rf"^handler {MOD}\.takes_two\(payload, extra\) cannot be called with one positional"),
        (keyword_only, rf"^handler {MOD}\.keyword_only\(\*, payload\) cannot be called"),
        (functools.partial(takes_two, 1, 2), (rf"^handler functools\.partial\({MOD}\.takes_two, \.\.\.\)\(\) "
                                             r"cannot be called.*e\.g\. def on_event\(payload\)")),
    ],
)
def test_check_runnable_refuses_what_the_worker_could_not_run(fn, message):
    with pytest.raises(ConfigurationError, match=message):
        check_runnable(fn, role="handler", argument="the event's payload", parameter="payload")


@pytest.mark.parametrize("fn", [on_paid, functools.partial(on_paid), AsyncNotifier(), AsyncNotifier().__call__])
def test_a_handler_may_be_async_def_and_awaits_says_so(fn):
    check_runnable(fn, role="handler", argument="the event's payload", parameter="payload", awaited=True)
    assert awaits(fn)


@pytest.mark.parametrize("fn", [generates, streams, SyncNotifier(), takes_two, functools.partial(takes_two, 1)])
def test_awaits_is_false_for_what_is_not_a_coroutine_function(fn):
    assert not awaits(fn)


def test_an_awaited_handler_is_still_refused_as_a_generator():
    with pytest.raises(ConfigurationError, match="is an async generator function"):
        check_runnable(streams, role="handler", argument="the event's payload", parameter="payload", awaited=True)


def with_default(payload, extra=None):
    pass


def positional_only(payload, /):
    pass


@pytest.mark.parametrize(
    "fn",
    [lambda payload: None, with_default, positional_only, lambda *args, **kwargs: None, SyncNotifier(),
     SyncNotifier().__call__, functools.partial(takes_two, 1), print, len, [].append, mock.Mock()],
    # Names, not repr: an address in a test id differs between pytest-xdist's processes (scripts/test).
    ids=["lambda", "default", "positional-only", "varargs", "instance", "bound-call", "partial", "print", "len",
         "bound-builtin", "mock"],
)
def test_check_runnable_accepts_what_takes_one_positional_argument(fn):
    check_runnable(fn, role="handler", argument="the event's payload", parameter="payload")


def test_check_runnable_lets_a_callable_without_a_readable_signature_be(monkeypatch):
    # Some builtins and extension callables have no signature to read: they are not refused for it.
    def unreadable(fn):
        raise ValueError("no signature found")

    monkeypatch.setattr(inspect, "signature", unreadable)
    check_runnable(takes_nothing, role="handler", argument="the event's payload", parameter="payload")


def test_check_runnable_names_the_role_and_the_argument():
    with pytest.raises(ConfigurationError, match=rf"^schedule 'tick': function {MOD}\.takes_two\(payload, "
                                                 r"extra\) cannot be called with one positional argument \(an Event\)"
                                                 r".*def takes_two\(event\)"):
        check_runnable(takes_two, role="schedule 'tick': function", argument="an Event", parameter="event")
