"""handlers.py and event.py: binding-key validation, exception classes, the Event a handler gets."""
from __future__ import annotations

import pytest

from kombu_events.errors import ConfigurationError
from kombu_events.event import Event
from kombu_events.handlers import check_prefetch, exception_classes, validate_binding_key


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
