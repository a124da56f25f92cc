"""A reader's records and names (core/readers.py): what it starts from, its position and rewind records (which
round-trip, and refuse what is not theirs), its queues (classic, whatever the service's type), and its inbox
key (offset and generation: a read again drops, a rewind runs again)."""
from __future__ import annotations

from datetime import datetime, timedelta, timezone
from types import SimpleNamespace

import pytest
from hypothesis import given, strategies as st

from kombu_events.core.config import resolve_settings
from kombu_events.core.event_log import event_log
from kombu_events.core.readers import (
    GENERATION_HEADER,
    OFFSET_HEADER,
    Position,
    Rewind,
    check_start,
    check_unique,
    reader,
    reader_key,
    reader_queues,
    stream_offset,
)
from kombu_events.core.topology import build_topology
from kombu_events.errors import ConfigurationError

LOG = event_log("shop", ("orders.#",), keep=timedelta(days=1))


def test_a_reader_has_a_lock_queue_and_a_position_queue_of_its_service():
    r = reader("shop", LOG, name="projector", start="first")
    assert (r.queue, r.position_queue, r.log) == ("shop.reader.projector", "shop.reader.projector.position", LOG)


@pytest.mark.parametrize("start", ["first", "last", "next", 0, 42, datetime(2026, 1, 1, tzinfo=timezone.utc)])
def test_where_a_reader_may_start(start):
    assert check_start(start) == start


@pytest.mark.parametrize("start, says", [
    ("middle", "'first', 'last', 'next'"), (-1, "an offset"), (True, "an offset"), (1.5, "an offset"),
    (datetime(2026, 1, 1), "aware datetime"), (None, "an offset")])
def test_a_start_it_cannot_is_refused_with_what_fits(start, says):
    with pytest.raises(ConfigurationError, match=says):
        check_start(start)


def test_a_time_goes_to_the_broker_as_a_naive_utc_timestamp():
    paris = timezone(timedelta(hours=1))
    assert stream_offset(datetime(2026, 1, 1, 13, 0, tzinfo=paris)) == datetime(2026, 1, 1, 12, 0)
    assert stream_offset("first") == "first" and stream_offset(7) == 7


def test_a_reader_needs_a_log_and_a_usable_name():
    with pytest.raises(ConfigurationError, match=r"pass what events\.log"):
        reader("shop", "orders", name="x", start="first")
    with pytest.raises(ConfigurationError, match="wildcard"):
        reader("shop", LOG, name="a.#", start="first")


def test_two_readers_of_one_name_are_refused():
    a = reader("shop", LOG, name="projector", start="first")
    with pytest.raises(ConfigurationError, match="two readers are named 'projector'"):
        check_unique(reader("shop", LOG, name="projector", start="last"), [a])


@given(st.integers(min_value=0, max_value=2**62), st.integers(min_value=0, max_value=2**31))
def test_a_position_round_trips(offset, generation):
    position = Position(offset, generation)
    assert Position.parse(position.body(reader="r", stream="s")) == position


@pytest.mark.parametrize("body", [b"", b"[]", b'{"offset": -1}', b'{"offset": "3"}', b'{"offset": 3, "generation": -2}',
                                  b"\xff", b'{"offset": true}'])
def test_what_is_not_a_position_is_refused(body):
    with pytest.raises(ValueError):
        Position.parse(body)


def test_a_rewind_round_trips_and_refuses_what_is_not_one():
    assert Rewind.parse(Rewind(5000, "by ops").body()) == Rewind(5000, "by ops")
    for body in (b"{}", b'{"offset": -5}', b"nope"):
        with pytest.raises(ValueError):
            Rewind.parse(body)


def test_the_inbox_key_is_the_offset_and_the_generation():
    event = SimpleNamespace(headers={OFFSET_HEADER: 17, GENERATION_HEADER: 2})
    assert reader_key(event) == "17@2"
    assert reader_key(SimpleNamespace(headers={OFFSET_HEADER: 17})) == "17@0"
    assert reader_key(SimpleNamespace(headers={OFFSET_HEADER: 17, GENERATION_HEADER: 3})) != "17@2"


def test_its_queues_are_classic_and_the_position_keeps_one_message():
    lock, position = reader_queues([reader("shop", LOG, name="projector", start="first")])
    assert lock.queue_arguments == {"x-queue-type": "classic"} and lock.durable
    assert position.queue_arguments == {"x-queue-type": "classic", "x-max-length": 1, "x-overflow": "drop-head"}


def test_the_topology_holds_the_readers_queues_in_their_own_role_even_on_quorum():
    settings = resolve_settings("shop", {"queue_type": "quorum"})
    r = reader("shop", LOG, name="projector", start="first")
    topology = build_topology(settings, (), (), [LOG], [r])
    by_name = {q.name: q for q in topology.queues}
    assert topology.role(r.queue) == topology.role(r.position_queue) == "reader"
    assert by_name[r.queue].queue_arguments["x-queue-type"] == "classic"
    assert r.queue not in {q.name for q in topology.handler_queues}
