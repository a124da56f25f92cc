"""The archive's settlement records and how a reader folds them in (core/archive_records.py), the header table
of an archived copy packed for the stream (broker/stream_headers.py), and how a stream record is read
(ops/archive._parse): a copy, or a settlement -- never a publisher's imitation of one."""
from __future__ import annotations

import datetime
import decimal
import json

import pytest
from amqp.serialization import dumps, loads
from hypothesis import given, strategies as st

from kombu_events.broker import stream_headers
from kombu_events.core import archive_records as records, wire
from kombu_events.ops.archive import ArchivedMessage, parse_record as _parse


class Stored:
    """A message as a stream consumer gets it."""

    def __init__(self, body: bytes, headers: dict, offset: int, **properties):
        self.body = body
        self.properties = {**properties, "application_headers": {**headers, "x-stream-offset": offset}}
        self.delivery_info = {"routing_key": ""}


def settlement(action, keys, offset):
    body, properties = records.settlement_record(action, keys, by="ops", note="n")
    return Stored(body, properties["application_headers"], offset)


def test_a_settlement_record_names_its_keys_who_and_when():
    body, properties = records.settlement_record(records.PURGED, ["k1", "k2"], by="alice", note="GDPR request 7")
    data = json.loads(body)
    assert properties["application_headers"] == {wire.SETTLEMENT: "purged"}
    assert data["keys"] == ["k1", "k2"] and data["by"] == "alice" and data["note"] == "GDPR request 7"
    assert datetime.datetime.fromisoformat(data["at"]).tzinfo is not None
    parsed = records.parse_settlement(properties["application_headers"], body, 9)
    assert parsed.keys == ("k1", "k2") and parsed.action == "purged" and parsed.offset == 9


def test_an_unknown_action_is_refused():
    with pytest.raises(ValueError, match="unknown settlement action"):
        records.settlement_record("deleted", ["k"], by=None)


def test_an_unreadable_settlement_settles_nothing():
    parsed = records.parse_settlement({wire.SETTLEMENT: "purged"}, b"\xff not json", 3)
    assert parsed.keys == () and "unreadable" in parsed.note


def test_the_fold_keeps_pending_copies_in_order_and_drops_settled_ones():
    fold = records.Fold()
    for key in ("a", "b", "c", "d"):
        fold.add(key, key.upper())
    fold.settle(records.Settlement("replayed", ("b",), "x", "t"))
    fold.settle(records.Settlement("purged", ("d", "zz"), "x", "t"))
    assert fold.pending() == ["A", "C"]
    assert not fold.is_pending("b") and fold.is_pending("c")
    assert fold.settled["d"].action == "purged" and fold.settlements == 2
    assert "b" not in fold.copies, "a settled copy is not held (memory follows what is pending)"


def test_a_copy_written_twice_counts_once_and_a_settled_key_never_comes_back():
    fold = records.Fold()
    assert fold.add("a", 1) and not fold.add("a", 2)
    assert fold.pending() == [1], "the first record of a key counts"
    fold.settle(records.Settlement("purged", ("a",), "x", "t"))
    assert not fold.add("a", 3), "a copy of a settled key read again (a rewrite's copy) stays settled"
    assert fold.pending() == []


def test_the_first_settlement_of_a_key_counts():
    fold = records.Fold()
    fold.add("a", 1)
    fold.settle(records.Settlement("replayed", ("a",), "x", "t1"))
    fold.settle(records.Settlement("purged", ("a",), "y", "t2"))
    assert fold.settled["a"].action == "replayed"


def test_a_record_is_read_as_a_copy_with_its_key_and_offset():
    headers = wire.archive_headers({"tenant": "acme"}, attempt=3, queue="svc.q", routing_key="orders.1",
                                   reason="boom", exception="ValueError", traceback="tb")
    properties = stream_headers.pack({"application_headers": headers, "message_id": "m-1"})
    copy = _parse(41, Stored(b"x" * 10, properties["application_headers"], 41, message_id="m-1"), 4)
    assert isinstance(copy, ArchivedMessage)
    assert copy.key == headers[wire.ARCHIVE_KEY] and len(copy.key) == 20 and copy.offset == 41
    assert copy.id == "m-1" and copy.queue == "svc.q" and copy.routing_key == "orders.1"
    assert copy.body == b"xxxx" and copy.size == 10 and copy.truncated
    assert copy.headers["tenant"] == "acme" and stream_headers.PACKED not in copy.headers


def test_a_copy_of_an_earlier_version_is_keyed_by_its_offset():
    copy = _parse(7, Stored(b"{}", {wire.QUEUE: "svc.q", wire.ARCHIVED_AT: "t"}, 7), None)
    assert copy.key == "@7" and not copy.truncated


def test_a_settlement_record_is_read_as_a_settlement():
    parsed = _parse(5, settlement("purged", ["k"], 5), None)
    assert isinstance(parsed, records.Settlement) and parsed.keys == ("k",)


def test_a_publishers_settlement_header_never_makes_a_copy_a_settlement():
    forged = {wire.SETTLEMENT: "purged"}
    headers = wire.archive_headers(forged, attempt=1, queue="svc.q", routing_key="k", reason="r", exception="",
                                   traceback="")
    assert wire.SETTLEMENT not in headers, "archiving drops it"
    assert wire.SETTLEMENT not in wire.replay_headers(forged, archive_key="k1")
    body = json.dumps({"keys": ["victim"]}).encode()
    stored = stream_headers.pack({"application_headers": {**headers, wire.SETTLEMENT: "purged"}})
    assert isinstance(_parse(1, Stored(body, stored["application_headers"], 1), None), ArchivedMessage)
    old_copy = {wire.SETTLEMENT: "purged", wire.ARCHIVED_AT: "t"}  # an earlier version kept the header
    assert isinstance(_parse(2, Stored(body, old_copy, 2), None), ArchivedMessage)


def test_archive_keys_are_unique():
    keys = {wire.new_archive_key() for _ in range(10_000)}
    assert len(keys) == 10_000


def test_a_replayed_copy_carries_the_key_it_was_replayed_from_and_no_failure_header():
    headers = wire.archive_headers({"tenant": "acme"}, attempt=3, queue="q", routing_key="k", reason="r",
                                   exception="E", traceback="tb")
    replayed = wire.replay_headers(headers, archive_key=headers[wire.ARCHIVE_KEY])
    assert replayed[wire.REPLAY_OF] == headers[wire.ARCHIVE_KEY]
    assert wire.ARCHIVE_KEY not in replayed and wire.REASON not in replayed and replayed["tenant"] == "acme"


# What a stream would drop (arrays, tables) or refuse (decimals, closing the connection) travels packed.
header_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**63, 2**63 - 1) | st.text(max_size=20)
    | st.binary(max_size=20) | st.decimals(allow_nan=False, allow_infinity=False, places=2, min_value=-10**6,
                                           max_value=10**6)
    | st.datetimes(min_value=datetime.datetime(1971, 1, 1), max_value=datetime.datetime(2100, 1, 1)).map(
        lambda d: d.replace(microsecond=0)),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(min_size=1, max_size=8), inner, max_size=4),
    max_leaves=12)


@given(st.dictionaries(st.text(min_size=1, max_size=12), header_values, max_size=6))
def test_a_packed_header_table_comes_back_as_it_was(table):
    packed = stream_headers.pack({"application_headers": table, "message_id": "m"})
    assert packed["message_id"] == "m"
    plain = packed["application_headers"]
    assert all(isinstance(v, (str, int, float, bool, bytes, type(None))) for v in plain.values()), \
        "only values a stream keeps travel unpacked"
    as_amqp_reads_it = loads("F", dumps("F", [table]), 0)[0][0]  # bytes come back as text, as from any queue
    assert stream_headers.unpack(plain) == as_amqp_reads_it


def test_the_librarys_own_headers_stay_readable_beside_the_packed_table():
    table = {wire.QUEUE: "svc.q", "x-tags": ["a", 1], "amount": decimal.Decimal("1.25")}
    plain = stream_headers.pack({"application_headers": table})["application_headers"]
    assert plain[wire.QUEUE] == "svc.q" and "x-tags" not in plain and "amount" not in plain
    assert stream_headers.unpack({wire.QUEUE: "only plain"}) == {wire.QUEUE: "only plain"}
