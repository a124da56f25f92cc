"""AMQP 0-9-1 basic properties by hand: write what py-amqp cannot, read whatever the broker holds.

RabbitMQ accepts frames py-amqp never writes and cannot read back (invalid UTF-8 in short
strings, timestamps past year 9999, tables nested deeper than Python's recursion limit, field
types py-amqp does not emit). :class:`HandEncoded` sends them; :func:`total_property_decoder`
lets this process's py-amqp read any message back, so a test can account for every one.
"""
from __future__ import annotations

__all__ = ["Field", "field_bytes", "table_bytes", "encode_properties", "HandEncoded", "nested_tables",
           "nested_arrays", "timestamp_field", "total_property_decoder"]

import calendar
import struct
import sys
from contextlib import contextmanager
from datetime import datetime
from decimal import Decimal
from typing import Any, Iterator

import amqp
import amqp.serialization


class Field:
    """A field-table value given as its wire bytes: type letter + payload."""

    def __init__(self, letter: bytes, payload: bytes = b"") -> None:
        self.data = letter + payload

    def __repr__(self) -> str:
        return f"Field({self.data[:12]!r}{'...' if len(self.data) > 12 else ''})"


def _shortstr(value: str | bytes) -> bytes:
    data = value.encode() if isinstance(value, str) else value
    return struct.pack("B", len(data)) + data


def field_bytes(value: Any) -> bytes:
    """The wire bytes of one field value (type letter first); ints are 'l', floats 'd'."""
    if isinstance(value, Field):
        return value.data
    if isinstance(value, str):
        value = value.encode("utf-8", "surrogatepass")
    if isinstance(value, bytes):
        return b"S" + struct.pack(">I", len(value)) + value
    if isinstance(value, bool):
        return b"t" + struct.pack("B", value)
    if isinstance(value, int):
        return b"l" + struct.pack(">q", value)
    if isinstance(value, float):
        return b"d" + struct.pack(">d", value)
    if isinstance(value, Decimal):
        sign, digits, exponent = value.as_tuple()
        return b"D" + struct.pack(">Bi", -exponent, int("".join(map(str, digits))) * (-1 if sign else 1))
    if isinstance(value, datetime):
        return b"T" + struct.pack(">Q", calendar.timegm(value.utctimetuple()))
    if isinstance(value, dict):
        return b"F" + _table(value)
    if isinstance(value, (list, tuple)):
        return b"A" + _array(value)
    if value is None:
        return b"V"
    raise TypeError(f"no AMQP field type for {value!r}")


def _table(table: dict) -> bytes:
    return table_bytes(b"".join(_shortstr(key) + field_bytes(value) for key, value in table.items()))


def _array(items: Any) -> bytes:
    return table_bytes(b"".join(field_bytes(value) for value in items))


_BASIC = [("content_type", "s"), ("content_encoding", "s"), ("application_headers", "F"),
          ("delivery_mode", "o"), ("priority", "o"), ("correlation_id", "s"), ("reply_to", "s"),
          ("expiration", "s"), ("message_id", "s"), ("timestamp", "L"), ("type", "s"),
          ("user_id", "s"), ("app_id", "s"), ("cluster_id", "s")]


def encode_properties(properties: dict[str, Any]) -> bytes:
    """Property flags + list; short strings may be bytes (any octets), headers a dict or a Field."""
    flags, out = 0, []
    for bit, (name, kind) in zip(range(15, 1, -1), _BASIC):
        value = properties.get(name)
        if value is None:
            continue
        flags |= 1 << bit
        if kind == "s":
            out.append(_shortstr(value))
        elif kind == "o":
            out.append(struct.pack("B", value))
        elif kind == "L":
            out.append(struct.pack(">Q", value))
        else:
            out.append(value.data[1:] if isinstance(value, Field) else _table(value))
    return struct.pack(">H", flags) + b"".join(out)


class HandEncoded(amqp.Message):
    """An ``amqp.Message`` whose properties are written by :func:`encode_properties`."""

    def _serialize_properties(self) -> bytes:
        return encode_properties(self.properties)


def nested_tables(depth: int) -> Field:
    """``{"k": {"k": ... None}}``, ``depth`` tables deep."""
    data = b"V"
    for _ in range(depth):
        data = b"F" + table_bytes(b"\x01k" + data)
    return Field(data[:1], data[1:])


def nested_arrays(depth: int) -> Field:
    """``[[[... None]]]``, ``depth`` arrays deep."""
    data = b"V"
    for _ in range(depth):
        data = b"A" + table_bytes(data)
    return Field(data[:1], data[1:])


def table_bytes(data: bytes) -> bytes:
    """``data`` (the encoded entries of a table or items of an array) with its length in front."""
    return struct.pack(">I", len(data)) + data


def timestamp_field(seconds: int) -> Field:
    """A 'T' value of any 64-bit count of seconds (py-amqp writes datetimes only, up to year 9999)."""
    return Field(b"T", struct.pack(">Q", seconds))


def _read_value(buf: bytes, offset: int) -> tuple[Any, int]:
    """One field value, like py-amqp's reader but total: bad UTF-8 stays bytes, 'T' stays an int."""
    letter = buf[offset:offset + 1]
    offset += 1
    fixed = {b"b": ">b", b"B": ">B", b"s": ">h", b"u": ">H", b"U": ">h", b"I": ">i", b"i": ">I", b"L": ">q",
             b"l": ">q", b"f": ">f", b"d": ">d", b"T": ">Q"}
    if letter in fixed:
        (value,) = struct.unpack_from(fixed[letter], buf, offset)
        return value, offset + struct.calcsize(fixed[letter])
    if letter == b"t":
        return bool(buf[offset]), offset + 1
    if letter == b"V":
        return None, offset
    if letter == b"D":
        scale, n = struct.unpack_from(">Bi", buf, offset)
        return Decimal(n).scaleb(-scale), offset + 5
    (size,) = struct.unpack_from(">I", buf, offset)
    start, end = offset + 4, offset + 4 + size
    if letter == b"S":
        data = buf[start:end]
        try:
            return data.decode(), end
        except UnicodeDecodeError:
            return bytes(data), end
    if letter == b"x":
        return bytes(buf[start:end]), end
    if letter == b"F":
        return _read_table(buf, start, end), end
    if letter == b"A":
        items, offset = [], start
        while offset < end:
            item, offset = _read_value(buf, offset)
            items.append(item)
        return items, end
    raise ValueError(f"unknown field type {letter!r}")


def _read_table(buf: bytes, offset: int, end: int) -> dict:
    table: dict = {}
    while offset < end:
        size = buf[offset]
        key = bytes(buf[offset + 1:offset + 1 + size])
        table[key.decode("utf-8", "surrogateescape")], offset = _read_value(buf, offset + 1 + size)
    return table


def _decode_properties(buf: bytes, offset: int) -> tuple[dict[str, Any], int]:
    (flags,) = struct.unpack_from(">H", buf, offset)
    offset += 2
    properties: dict[str, Any] = {}
    for bit, (name, kind) in zip(range(15, 1, -1), _BASIC):
        if not flags & (1 << bit):
            continue
        if kind == "s":
            size = buf[offset]
            properties[name] = bytes(buf[offset + 1:offset + 1 + size]).decode("utf-8", "surrogateescape")
            offset += 1 + size
        elif kind == "o":
            properties[name], offset = buf[offset], offset + 1
        elif kind == "L":
            (properties[name],), offset = struct.unpack_from(">Q", buf, offset), offset + 8
        else:
            (size,) = struct.unpack_from(">I", buf, offset)
            properties[name], offset = _read_table(buf, offset + 4, offset + 4 + size), offset + 4 + size
    return properties, offset


@contextmanager
def total_property_decoder() -> Iterator[None]:
    """Let this process's py-amqp read properties it would choke on (the test must see every message)."""
    classes = amqp.serialization.PROPERTY_CLASSES
    original = classes[amqp.spec.Basic.CLASS_ID]

    def decode(buf: bytes, offset: int) -> tuple[dict[str, Any], int]:
        try:
            return original(buf, offset)
        except Exception:  # UnicodeDecodeError, ValueError/OverflowError for 'T', RecursionError, ...
            return _decode_properties(buf, offset)

    limit = sys.getrecursionlimit()
    classes[amqp.spec.Basic.CLASS_ID] = decode
    sys.setrecursionlimit(max(limit, 50_000))
    try:
        yield
    finally:
        classes[amqp.spec.Basic.CLASS_ID] = original
        sys.setrecursionlimit(limit)
