"""``log status`` (ops/log_status.py) without a broker: each log's row from what the stream and the management API
say (the reads monkeypatched), valid against its JSON Schema; timestamps as ISO 8601 UTC."""
from __future__ import annotations

from datetime import datetime, timedelta, timezone
from types import SimpleNamespace

import pytest
from jsonschema import Draft202012Validator

from kombu_events.broker.declare import QueueCounts
from kombu_events.cli.common import schema
from kombu_events.core.config import resolve_settings
from kombu_events.core.event_log import event_log
from kombu_events.core.topology import build_topology
from kombu_events.ops import log_status
from kombu_events.ops.log_status import Position, _iso, gather_logs


def _topology():
    logs = (event_log("billing", ("orders.#",), keep=timedelta(days=90)),
            event_log("billing", ("audit.#",), max_bytes=10**7, name="audit"),
            event_log("billing", ("gone.#",), keep=timedelta(hours=1)))
    return build_topology(resolve_settings("billing", None, exchange="ev"), (), (), logs)


@pytest.fixture
def broker(monkeypatch):
    """Stream ``billing.log.orders`` holds offsets 5 .. 9, ``audit`` is empty, ``gone`` does not exist; the
    management API says 2 segments for ``orders`` and nothing else."""
    first = Position(5, "2026-01-01T00:00:00+00:00")
    last = Position(9, None)
    counts = {"billing.log.orders": QueueCounts(0, 1), "billing.log.audit": QueueCounts(0, 0)}
    monkeypatch.setattr(log_status, "peek_queue", lambda conn, name: counts.get(name))
    monkeypatch.setattr(log_status, "position_of", lambda conn, name, wait_s: (
        (first, last) if name == "billing.log.orders" else (None, None)))
    monkeypatch.setattr(log_status, "queue_statistics", lambda conn, name, url: {"segments": 2}
                        if name == "billing.log.orders" else {})
    return SimpleNamespace(hostname="rabbit")


def test_each_log_row_says_what_the_stream_holds(broker):
    orders, audit, gone = gather_logs(broker, _topology())
    assert (orders.messages, orders.first, orders.last, orders.segments, orders.consumers) == (
        5, Position(5, "2026-01-01T00:00:00+00:00"), Position(9, None), 2, 1)
    assert (orders.max_age, orders.max_bytes, orders.binding_keys) == ("90D", None, ["orders.#"])
    assert (audit.messages, audit.first, audit.last, audit.max_age, audit.max_bytes, audit.segment_bytes) == (
        0, None, None, None, 10**7, 2_500_000)
    assert (gone.exists, gone.messages, gone.consumers) == (False, None, None)


def test_the_rows_validate_against_the_schema(broker):
    rows = [row.as_dict() for row in gather_logs(broker, _topology())]
    errors = list(Draft202012Validator(schema("log-status")).iter_errors(rows))
    assert not errors, errors


def test_a_management_api_that_does_not_answer_is_asked_once(broker, monkeypatch):
    asked = []
    monkeypatch.setattr(log_status, "queue_statistics", lambda conn, name, url: asked.append(url))
    rows = gather_logs(broker, _topology(), "http://mgmt:15672/")
    assert asked == ["http://mgmt:15672"] and [r.management for r in rows] == [False] * 3
    assert all(r.segments is None for r in rows)


@pytest.mark.parametrize(("stamp", "iso"), [
    (datetime(2026, 1, 2, 3, 4, 5), "2026-01-02T03:04:05+00:00"),  # py-amqp: naive UTC
    (datetime(2026, 1, 2, 3, 4, 5, tzinfo=timezone.utc), "2026-01-02T03:04:05+00:00"),
    (0, "1970-01-01T00:00:00+00:00"),
    (None, None), ("yesterday", None), (True, None),
])
def test_a_timestamp_property_as_iso_8601_utc(stamp, iso):
    assert _iso(stamp) == iso
