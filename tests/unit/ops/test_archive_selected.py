"""``archive.selected``: what a dry run shows and the offset that pins it (``--through``), over records kept in
memory (no broker)."""
from __future__ import annotations

import dataclasses

import pytest

from kombu_events.core.archive_records import PURGED, Settlement
from kombu_events.ops import archive_read
from kombu_events.ops.archive import ArchivedMessage, selected

from ..console.test_console_routes_kit import archived, events_of_svc


def copy_at(offset: int, message_id: str, handler: str = "orders") -> ArchivedMessage:
    return dataclasses.replace(archived(message_id, handler), offset=offset)


@pytest.fixture
def stream(monkeypatch):
    """``stream(*records)``: the archive holds ``records`` (copies and settlements, offsets as given)."""
    def hold(*held):
        monkeypatch.setattr(archive_read, "records", lambda connection, topology, **kwargs: iter(held))
    return hold


def test_the_pin_is_the_last_offset_read_even_past_the_last_copy_selected(stream):
    stream(copy_at(1, "m1"), copy_at(2, "u1", "users"), copy_at(3, "m2"),
           Settlement(PURGED, (archived("u1", "users").key,), "x", "t", offset=4), copy_at(5, "u2", "users"))
    chosen, through = selected(None, events_of_svc().topology(), lambda m: m.queue == "svc.orders")
    assert [(m.id, m.offset) for m in chosen] == [("m1", 1), ("m2", 3)] and through == 5


def test_a_limit_pins_the_set_at_the_last_copy_it_took(stream):
    """A copy after it, selected without the limit, must not be taken by the pinned run when one of these was
    settled meanwhile: the pin stops at the last copy shown."""
    stream(copy_at(1, "m1"), copy_at(2, "m2"), copy_at(3, "m3"))
    chosen, through = selected(None, events_of_svc().topology(), limit=2)
    assert [m.id for m in chosen] == ["m1", "m2"] and through == 2
    assert selected(None, events_of_svc().topology(), limit=3)[1] == 3


def test_an_empty_stream_pins_nothing(stream):
    stream()
    assert selected(None, events_of_svc().topology()) == ([], None)
