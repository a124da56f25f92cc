"""broker/lenient_amqp.py: frames py-amqp's strict decoders raise on are decoded leniently, the rest
exactly as before.
"""
from __future__ import annotations

import logging
from datetime import datetime
from decimal import Decimal
from struct import error as struct_error, pack

import amqp
import amqp.abstract_channel
import amqp.serialization
import pytest
from amqp.exceptions import FrameSyntaxError
from amqp.spec import Basic

from kombu_events.broker import lenient_amqp as wire_guard
from kombu_events.core.delivery import UNREADABLE
from kombu_events.core.wire import UNREADABLE_HEADERS, as_sent

STRICT_PROPERTIES = amqp.serialization.decode_properties_basic
STRICT_LOADS = amqp.serialization.loads
DELIVER_ARGS = "sLbss"  # basic.deliver: consumer tag, delivery tag, redelivered, exchange, routing key

#: Basic property flag bits, in wire order.
BITS = {"content_type": 15, "content_encoding": 14, "application_headers": 13, "delivery_mode": 12,
        "priority": 11, "correlation_id": 10, "reply_to": 9, "expiration": 8, "message_id": 7, "timestamp": 6,
        "type": 5, "user_id": 4, "app_id": 3, "cluster_id": 2}


def _frame(**fields: bytes | int) -> bytes:
    """Raw property flags and fields; shortstr values as raw bytes, a table as its raw item bytes."""
    flags, out = 0, b""
    for name, bit in BITS.items():
        if name not in fields:
            continue
        flags |= 1 << bit
        value = fields[name]
        if name == "application_headers":
            out += pack(">I", len(value)) + value
        elif name in ("delivery_mode", "priority"):
            out += pack(">B", value)
        elif name == "timestamp":
            out += pack(">Q", value)
        else:
            out += pack(">B", len(value)) + value
    return pack(">H", flags) + out


def _item(key: bytes, kind: bytes, value: bytes) -> bytes:
    return pack(">B", len(key)) + key + kind + value


def _longstr(raw: bytes) -> bytes:
    return pack(">I", len(raw)) + raw


def _sent(text: str) -> bytes:
    """The bytes a copy carries for ``text``: as_sent's, encoded as py-amqp encodes text."""
    value = as_sent(text)
    return value if isinstance(value, bytes) else value.encode("utf-8", "surrogatepass")


def _nested_arrays(depth: int) -> bytes:
    value = pack(">I", 0)
    for _ in range(depth - 1):
        value = pack(">I", len(value) + 1) + b"A" + value
    return value


GOOD_ITEM = _item(b"x-request-id", b"S", _longstr(b"r-1"))
GOOD = {"content_encoding": b"utf-8", "delivery_mode": 2, "priority": 5, "correlation_id": b"c-1",
        "timestamp": 1_700_000_000, "user_id": b"guest", "app_id": b"shop"}

BAD_TABLES = {
    "timestamp beyond 9999": (_item(b"when", b"T", pack(">Q", 2**63)), "'when'"),
    "5,000 nested arrays": (_item(b"deep", b"A", _nested_arrays(5000)), "'deep'"),
    "unknown field type": (_item(b"odd", b"Z", b"\x00\x00"), "'odd'"),
}


@pytest.fixture
def guard(monkeypatch: pytest.MonkeyPatch):
    """``install()`` for one test: py-amqp's decoders are put back afterwards."""
    monkeypatch.setattr(amqp.abstract_channel, "loads", amqp.abstract_channel.loads)
    monkeypatch.setitem(amqp.serialization.PROPERTY_CLASSES, Basic.CLASS_ID,
                        amqp.serialization.PROPERTY_CLASSES[Basic.CLASS_ID])
    monkeypatch.setattr(wire_guard, "_installed", [])
    wire_guard.install()
    return amqp.serialization.PROPERTY_CLASSES[Basic.CLASS_ID]


# -- decode_properties_leniently -----------------------------------------------------------------

@pytest.mark.parametrize("name", ["content_type", "message_id", "reply_to", "cluster_id"])
def test_text_that_is_not_utf8_keeps_its_bytes(name):
    frame = _frame(**GOOD, **{name: b"caf\xe9\xff"}, application_headers=GOOD_ITEM)
    with pytest.raises(UnicodeDecodeError):
        STRICT_PROPERTIES(frame, 0)
    properties, offset = wire_guard.decode_properties_leniently(frame, 0)
    assert offset == len(frame)
    assert properties[UNREADABLE] == f"property {name} is not valid UTF-8"
    assert _sent(properties[name]) == b"caf\xe9\xff"
    assert properties["application_headers"] == {"x-request-id": "r-1"}
    assert {k: properties[k] for k in ("content_encoding", "delivery_mode", "priority", "correlation_id",
                                       "timestamp", "user_id", "app_id")} == {
        "content_encoding": "utf-8", "delivery_mode": 2, "priority": 5, "correlation_id": "c-1",
        "timestamp": 1_700_000_000, "user_id": "guest", "app_id": "shop"}


@pytest.mark.parametrize("item, key, strict_error", [
    (*BAD_TABLES["timestamp beyond 9999"], (OverflowError, ValueError, OSError)),
    (*BAD_TABLES["5,000 nested arrays"], RecursionError),
    (*BAD_TABLES["unknown field type"], FrameSyntaxError),
], ids=BAD_TABLES.keys())
def test_a_table_py_amqp_cannot_decode_is_kept_whole_as_bytes(item, key, strict_error):
    table = GOOD_ITEM + item
    frame = _frame(content_type=b"application/json", **GOOD, application_headers=table, message_id=b"m-1")
    with pytest.raises(strict_error):
        STRICT_PROPERTIES(frame, 0)
    properties, offset = wire_guard.decode_properties_leniently(frame, 0)
    assert offset == len(frame)
    assert properties["application_headers"] == {UNREADABLE_HEADERS: table}
    assert properties[UNREADABLE].startswith(f"header {key} cannot be decoded (")
    assert UNREADABLE_HEADERS in properties[UNREADABLE]
    assert (properties["content_type"], properties["message_id"], properties["user_id"]) == (
        "application/json", "m-1", "guest")


def test_every_problem_is_named():
    item, _key = BAD_TABLES["unknown field type"]
    frame = _frame(content_type=b"\xff", application_headers=item, message_id=b"m-\xfe")
    properties, _ = wire_guard.decode_properties_leniently(frame, 0)
    assert properties[UNREADABLE].startswith("property content_type is not valid UTF-8; header 'odd' cannot be "
                                             "decoded (")
    assert properties[UNREADABLE].endswith("; property message_id is not valid UTF-8")


def test_a_table_whose_items_are_not_even_framed_names_no_header():
    table = b"\x20"  # a key length pointing past the end of the table
    frame = _frame(application_headers=table, message_id=b"m-1")
    properties, offset = wire_guard.decode_properties_leniently(frame, 0)
    assert offset == len(frame)
    assert properties["application_headers"] == {UNREADABLE_HEADERS: table}
    assert properties["message_id"] == "m-1"
    assert properties[UNREADABLE].startswith("header cannot be decoded (")


def test_properties_at_an_offset_in_a_larger_buffer():
    frame = _frame(content_type=b"\xff", message_id=b"m-1")
    properties, offset = wire_guard.decode_properties_leniently(b"\x00" * 12 + frame + b"\xce", 12)
    assert offset == 12 + len(frame)
    assert properties["message_id"] == "m-1"


# -- install() -----------------------------------------------------------------------------------

def test_install_is_idempotent(guard):
    loads = amqp.abstract_channel.loads
    wire_guard.install()
    wire_guard.install()
    assert amqp.serialization.PROPERTY_CLASSES[Basic.CLASS_ID] is guard
    assert amqp.abstract_channel.loads is loads
    assert guard is not STRICT_PROPERTIES and loads is not STRICT_LOADS


GOOD_PROPERTIES = {
    "content_type": "application/json", "content_encoding": "utf-8", "delivery_mode": 2, "priority": 9,
    "correlation_id": "c-1", "reply_to": "amq.rabbitmq.reply-to", "expiration": "60000", "message_id": "m-1",
    "timestamp": 1_700_000_000, "type": "order.created", "user_id": "guest", "app_id": "shop", "cluster_id": "c",
    "application_headers": {
        "text": "Zoë", "bytes": b"\x00\xff", "int": -7, "long": 2**40, "float": 2.5, "bool": True, "none": None,
        "decimal": Decimal("12.34"), "when": datetime(2024, 5, 1, 12, 0, 0),
        "nested": {"list": [1, "two", [3.0, {"deep": False}]]},
    },
}


@pytest.mark.parametrize("properties", [GOOD_PROPERTIES, {}, {"message_id": "m-1"},
                                        {"application_headers": {}}, {"content_type": "ünïcödé/json"}])
def test_after_install_a_good_frame_decodes_exactly_as_before(guard, properties, caplog):
    frame = amqp.Message(b"", **properties)._serialize_properties()
    buffer = b"\x00" * 12 + frame
    with caplog.at_level(logging.WARNING, logger=wire_guard.__name__):
        assert guard(buffer, 12) == STRICT_PROPERTIES(buffer, 12)
    assert not caplog.records


def test_after_install_a_bad_frame_is_decoded_leniently_and_logged(guard, caplog):
    frame = _frame(content_type=b"\xff", message_id=b"m-1")
    with caplog.at_level(logging.WARNING, logger=wire_guard.__name__):
        properties, offset = guard(frame, 0)
    assert (properties["message_id"], properties[UNREADABLE], offset) == (
        "m-1", "property content_type is not valid UTF-8", len(frame))
    assert "UnicodeDecodeError" in caplog.text


def test_a_message_with_a_bad_frame_loads_its_properties(guard):
    message = amqp.Message()
    item, _key = BAD_TABLES["5,000 nested arrays"]
    frame = _frame(application_headers=item, message_id=b"m-1")
    message._load_properties(Basic.CLASS_ID, frame, 0)
    assert message.properties["message_id"] == "m-1"
    assert message.properties["application_headers"] == {UNREADABLE_HEADERS: item}


def test_properties_not_even_the_lenient_decoder_reads_leave_only_the_mark_and_never_raise(guard, caplog):
    frame = pack(">H", 1 << BITS["timestamp"])  # a timestamp said to follow, and no bytes: both decoders fail
    with pytest.raises(struct_error):
        wire_guard.decode_properties_leniently(frame, 0)
    with caplog.at_level(logging.WARNING, logger=wire_guard.__name__):
        properties, offset = guard(frame, 0)  # py-amqp's frame dispatch: raising here would end the worker
    assert list(properties) == [UNREADABLE] and offset == 0
    assert properties[UNREADABLE].startswith("properties cannot be decoded (")
    assert "cannot be decoded even leniently" in caplog.text


def _deliver(exchange: bytes, routing_key: bytes) -> bytes:
    """A basic.deliver method frame payload: class and method ids, then the arguments."""
    return pack(">HH", *Basic.Deliver) + amqp.serialization.dumps(
        DELIVER_ARGS, ["ctag-1", 42, True, exchange, routing_key])


@pytest.mark.parametrize("exchange, routing_key", [
    (b"events", b"orders.\xff.created"),
    (b"ev\xc3\x28nts", b"orders.1"),
    (b"\x80", b"\xfe\xff"),
])
def test_after_install_method_arguments_that_are_not_utf8_decode(guard, exchange, routing_key):
    payload = _deliver(exchange, routing_key)
    with pytest.raises(UnicodeDecodeError):
        STRICT_LOADS(DELIVER_ARGS, payload, 4)
    (tag, delivery_tag, redelivered, got_exchange, got_key), offset = amqp.abstract_channel.loads(
        DELIVER_ARGS, payload, 4)
    assert (tag, delivery_tag, redelivered, offset) == ("ctag-1", 42, True, len(payload))
    assert isinstance(got_key, str) and isinstance(got_exchange, str)
    assert (_sent(got_exchange), _sent(got_key)) == (exchange, routing_key)


@pytest.mark.parametrize("exchange, routing_key", [(b"events", b"orders.1.created"), (b"", "заказ.🦄".encode())])
def test_after_install_good_method_arguments_decode_as_before(guard, exchange, routing_key):
    payload = _deliver(exchange, routing_key)
    assert amqp.abstract_channel.loads(DELIVER_ARGS, payload, 4) == STRICT_LOADS(DELIVER_ARGS, payload, 4)


@pytest.mark.parametrize("raw", [
    b"orders.\xed\xa0\x80",
    b"orders.\xed\xb3\xbf",
])
def test_a_routing_key_the_strict_decoder_reads_goes_back_as_the_same_bytes(guard, raw):
    # Neither raises in py-amqp, so the guard never sees them: the strict decoder's text reaches as_sent.
    (*_, routing_key), _ = amqp.abstract_channel.loads(DELIVER_ARGS, _deliver(b"events", raw), 4)
    assert _sent(routing_key) == raw
