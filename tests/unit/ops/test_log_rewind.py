"""Where ``log rewind --to`` goes (ops/log_rewind.py): an offset as given; a time (UTC unless it says, "Z" too, on
every Python) to the first event whose timestamp property is at or after it, seconds or datetimes alike; no such
event, or neither an offset nor a time: one clear error."""
from __future__ import annotations

from datetime import datetime, timedelta, timezone
from types import SimpleNamespace

import pytest

from kombu_events.core.event_log import event_log
from kombu_events.core.readers import reader
from kombu_events.errors import KombuEventsError
from kombu_events.ops import log_rewind

READER = reader("shop", event_log("shop", ("orders.#",), keep=timedelta(days=1)), name="p", start="first")
T0 = 1_800_000_000  # seconds


def utc(seconds: int) -> datetime:
    """``seconds`` as py-amqp gives a timestamp it decodes: a naive UTC datetime."""
    return datetime.fromtimestamp(seconds, tz=timezone.utc).replace(tzinfo=None)


@pytest.fixture
def stream(monkeypatch):
    """Events at T0, T0, T0 + 1, T0 + 2 (offsets 10..13: two as seconds, two as py-amqp's naive datetimes)."""
    asked = []

    def follow(connection, queue, *, start, idle_s):
        asked.append(start)
        stamps = [T0, T0, utc(T0 + 1), utc(T0 + 2)]
        yield from ((10 + i, SimpleNamespace(properties={"timestamp": s})) for i, s in enumerate(stamps))
        yield None  # idle: the end
    monkeypatch.setattr(log_rewind, "follow", follow)
    return asked


def test_an_offset_is_taken_as_given():
    assert log_rewind.target_offset(None, READER, "5000") == 5000


@pytest.mark.parametrize("to, offset, when", [
    (utc(T0).isoformat() + "Z", 10, utc(T0)),
    (utc(T0 + 1).isoformat() + "+00:00", 12, utc(T0 + 1)),
    (utc(T0 + 1).isoformat(), 12, utc(T0 + 1)),  # UTC unless it says
    ((utc(T0 + 2) + timedelta(hours=1)).isoformat() + "+01:00", 13, utc(T0 + 2)),
])
def test_a_time_is_the_first_event_at_or_after_it(stream, to, offset, when):
    assert log_rewind.target_offset(None, READER, to) == offset
    assert stream == [when - log_rewind.TIME_MARGIN]  # the broker is asked, in naive UTC, a margin before


def test_a_time_after_the_last_event_and_what_is_no_time_are_clear_errors(stream):
    with pytest.raises(KombuEventsError, match="holds no event with a timestamp at or after"):
        log_rewind.target_offset(None, READER, utc(T0 + 3).isoformat())
    with pytest.raises(KombuEventsError, match="neither an offset"):
        log_rewind.target_offset(None, READER, "yesterday")
