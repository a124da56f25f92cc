"""core/names.py: the name helpers and validate_name."""
from __future__ import annotations

import pytest

from kombu_events.core import names
from kombu_events.errors import ConfigurationError, KombuEventsError


@pytest.mark.parametrize(
    "helper, args, expected",
    [
        (names.handler_queue, ("billing", "on_order_created"), "billing.on_order_created"),
        (names.handler_queue, ("billing.eu", "audit"), "billing.eu.audit"),
        (names.delay_name, ("billing", 0), "billing.delay.0"),
        (names.delay_name, ("billing", 15), "billing.delay.15"),
        (names.delivery_exchange, ("billing",), "billing.delivery"),
        (names.archive_name, ("billing",), "billing.archive"),
        (names.schedule_prefix, ("billing",), "billing.schedule."),
        (names.schedule_queue, ("billing", "reports.hourly"), "billing.schedule.reports.hourly"),
        (names.schedule_state, ("billing", "reports.hourly"), "billing.schedule.reports.hourly.state"),
    ],
)
def test_name_helpers(helper, args, expected):
    assert helper(*args) == expected


@pytest.mark.parametrize(
    "value",
    ["billing", "billing.audit", "a-b_c.1", "Événements", "a" * 255, "é" * 127 + "a"],
)
def test_validate_name_accepts_and_returns_usable_names(value):
    assert names.validate_name("queue", value) == value


@pytest.mark.parametrize(
    "value, problem, valid",
    [
        ("", "non-empty string", "non-empty string"),
        ("   ", "non-empty string", "non-empty string"),
        (None, "non-empty string", "non-empty string"),
        (42, "non-empty string", "non-empty string"),
        ("orders.*", "wildcard", "letters, digits"),
        ("orders.#", "wildcard", "letters, digits"),
        ("a*b", "wildcard", "letters, digits"),
        (" billing", "whitespace or control", "letters, digits"),
        ("billing ", "whitespace or control", "letters, digits"),
        ("bill ing", "whitespace or control", "letters, digits"),
        ("bill\ting", "whitespace or control", "letters, digits"),
        ("bill\ning", "whitespace or control", "letters, digits"),
        ("bill\x00ing", "whitespace or control", "letters, digits"),
        ("bill\x7fing", "whitespace or control", "letters, digits"),
        ("bill\u00a0ing", "whitespace or control", "letters, digits"),
        ("bill\u2028ing", "whitespace or control", "letters, digits"),
    ],
)
def test_validate_name_rejects_with_setting_and_what_is_valid(value, problem, valid):
    with pytest.raises(ConfigurationError) as info:
        names.validate_name("my_setting", value)
    message = str(info.value)
    assert message.startswith("my_setting")
    assert problem in message
    assert valid in message
    assert isinstance(info.value, KombuEventsError)


@pytest.mark.parametrize(
    "value, max_bytes, size",
    [
        ("a" * 256, 255, 256),
        ("é" * 128, 255, 256),  # 128 characters, but 256 bytes in UTF-8
        ("€" * 86, 255, 258),  # 3 bytes each
        ("😀" * 64, 255, 256),  # 4 bytes each
        ("é" * 6, 10, 12),
    ],
)
def test_validate_name_counts_utf8_bytes_not_characters(value, max_bytes, size):
    with pytest.raises(ConfigurationError) as info:
        names.validate_name("queue", value, max_bytes=max_bytes)
    message = str(info.value)
    assert message.startswith("queue=")
    assert f"{size} bytes" in message
    assert f"at most {max_bytes} bytes" in message


def test_validate_name_limit_is_inclusive():
    assert names.validate_name("q", "é" * 5, max_bytes=10) == "é" * 5
    with pytest.raises(ConfigurationError):
        names.validate_name("q", "é" * 5 + "a", max_bytes=10)


def test_amqp_short_string_limit():
    assert names.MAX_NAME_BYTES == 255
