"""py-amqp decoding that never raises on what a broker delivers; installed by the events step and the CLI.

RabbitMQ passes short strings and header tables through as bytes, so a publisher can
send what py-amqp cannot decode: invalid UTF-8 in a routing key or a property, a
timestamp header beyond the year 9999, tables nested past Python's recursion limit.
py-amqp raises from inside ``drain_events``, before any consumer callback runs; Celery
then ends the worker, and the broker redelivers the message to the next worker.

With the guard installed, the strict decoders still run first; only where they raise
is the frame decoded leniently: text that is not UTF-8 keeps its bytes (as surrogate
escapes, which :func:`kombu_events.core.wire.as_sent` turns back into the same bytes),
an undecodable header table is kept whole as bytes under ``kombu-events-unreadable-headers``,
and the message is marked (:data:`kombu_events.core.delivery.UNREADABLE`) so that the
consumer archives it with the reason. Messages py-amqp can decode are untouched.
"""
from __future__ import annotations

__all__ = ["install", "decode_properties_leniently"]

import logging
from struct import unpack_from
from typing import Any, Callable

import amqp.abstract_channel
import amqp.serialization
from amqp.spec import Basic

from ..core.delivery import UNREADABLE
from ..core.logs import escape_controls
from ..core.wire import UNREADABLE_HEADERS, Undecoded

logger = logging.getLogger(__name__)

#: Basic properties in wire order (property flag bits 15 .. 2) and how each is encoded.
_FIELDS = (
    ("content_type", "s"), ("content_encoding", "s"), ("application_headers", "F"), ("delivery_mode", "o"),
    ("priority", "o"), ("correlation_id", "s"), ("reply_to", "s"), ("expiration", "s"), ("message_id", "s"),
    ("timestamp", "Q"), ("type", "s"), ("user_id", "s"), ("app_id", "s"), ("cluster_id", "s"),
)

_installed: list[Callable[..., Any]] = []


def install() -> None:
    """Wrap py-amqp's method-argument and property decoders (once per process)."""
    if _installed:
        return
    strict_loads = amqp.abstract_channel.loads
    strict_properties = amqp.serialization.PROPERTY_CLASSES[Basic.CLASS_ID]

    def loads(format: Any, buf: Any, offset: int) -> Any:
        try:
            return strict_loads(format, buf, offset)
        except UnicodeDecodeError:  # a routing key or exchange name that is not UTF-8
            return strict_loads(format, _LenientBytes(buf), offset)

    def decode_properties(buf: Any, offset: int) -> Any:
        try:
            return strict_properties(buf, offset)
        except Exception as exc:
            logger.warning("kombu-events: message properties py-amqp cannot decode (%s: %s); decoded leniently",
                           type(exc).__name__, escape_controls(exc))
            return _leniently_or_marked(buf, offset)

    amqp.abstract_channel.loads = loads
    amqp.serialization.PROPERTY_CLASSES[Basic.CLASS_ID] = decode_properties
    _installed.extend((strict_loads, strict_properties))


def decode_properties_leniently(buf: Any, offset: int) -> tuple[dict[str, Any], int]:
    """Basic properties from a content header frame, whatever their bytes; problems named in ``UNREADABLE``."""
    flags, = unpack_from(">H", buf, offset)
    offset += 2
    properties: dict[str, Any] = {}
    problems = []
    for bit, (name, kind) in zip(range(15, 1, -1), _FIELDS):
        if not flags & (1 << bit):
            continue
        if kind == "s":
            size = buf[offset]
            properties[name] = text = Undecoded.of(bytes(buf[offset + 1:offset + 1 + size]))
            offset += 1 + size
            if isinstance(text, Undecoded):
                problems.append(f"property {name} is not valid UTF-8")
        elif kind == "F":
            size, = unpack_from(">I", buf, offset)
            end = offset + 4 + size
            try:
                (properties[name],), _ = amqp.serialization.loads("F", buf, offset)
            except Exception as exc:  # an out-of-range timestamp, nesting deeper than the recursion limit, ...
                properties[name] = {UNREADABLE_HEADERS: bytes(buf[offset + 4:end])}
                problems.append(f"header {_failing_key(buf, offset + 4, end)}cannot be decoded "
                                f"({type(exc).__name__}: {exc}); the raw table is kept in {UNREADABLE_HEADERS}")
            offset = end
        elif kind == "o":
            properties[name] = buf[offset]
            offset += 1
        else:
            properties[name], = unpack_from(">Q", buf, offset)
            offset += 8
    properties[UNREADABLE] = "; ".join(problems) or "properties cannot be decoded"
    return properties, offset


def _leniently_or_marked(buf: Any, offset: int) -> tuple[dict[str, Any], int]:
    """The properties decoded leniently; if even that raises, none but the mark: the message is archived.

    Raising here would raise out of py-amqp's ``drain_events`` and end the worker, and
    the broker would hand the same message to the next one.
    """
    try:
        return decode_properties_leniently(buf, offset)
    except Exception as exc:
        logger.exception("kombu-events: message properties cannot be decoded even leniently; the message is "
                         "archived without them")
        return {UNREADABLE: f"properties cannot be decoded ({type(exc).__name__}: {exc})"}, offset


def _failing_key(buf: Any, offset: int, end: int) -> str:
    """``'name' `` of the first header whose value py-amqp cannot decode ('' if none is found)."""
    read_item = getattr(amqp.serialization, "_read_item", None)
    try:
        while offset < end and read_item is not None:
            size = buf[offset]
            if offset + 1 + size >= end:
                return ""  # the table is not even framed: there is no header to name
            key = bytes(buf[offset + 1:offset + 1 + size]).decode("utf-8", "replace")
            try:
                _value, offset = read_item(buf, offset + 1 + size)
            except Exception:
                return f"{key!r} "
            if offset > end:
                return ""
    except Exception:  # a table whose very framing is broken: name nothing
        return ""
    return ""


class _LenientBytes(bytes):
    """Bytes whose slices decode invalid UTF-8 with surrogate escapes instead of raising."""

    def __getitem__(self, index: Any) -> Any:
        item = bytes.__getitem__(self, index)
        return _LenientSlice(item) if isinstance(index, slice) else item


class _LenientSlice(bytes):
    def decode(self, encoding: str = "utf-8", errors: str = "strict") -> str:
        return Undecoded.of(bytes(self))
