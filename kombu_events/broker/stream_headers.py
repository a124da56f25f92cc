"""Headers of a message written to a stream, kept exactly.

A stream stores messages in AMQP 1.0's format, and RabbitMQ (3.10 and 4.0 alike) converts
an AMQP 0-9-1 header table on the way: an array or a nested table is dropped, a decimal
value closes the publisher's connection (INTERNAL_ERROR). So a message archived into
the stream carries its whole header table serialized as AMQP 0-9-1 writes it, as one
bytes value (:data:`PACKED`), beside the library's own headers as plain ones (for whoever
looks at the stream with other tools); :func:`unpack` gives the table back as it was. The packed
bytes travel as base64 text: py-amqp reads a long string back as text when it happens to be UTF-8,
as bytes when not, and text is what every reader gets back unchanged.
"""
from __future__ import annotations

__all__ = ["PACKED", "pack", "unpack"]

import base64
from typing import Any, Mapping

from amqp.serialization import dumps, loads

from ..core import wire

#: The whole header table of an archived copy, serialized as AMQP 0-9-1 does (a field table).
PACKED = wire.PACKED_HEADERS
_PLAIN = (str, int, float, bool, bytes, type(None))


def pack(properties: Mapping[str, Any]) -> dict[str, Any]:
    """``properties`` with the header table packed (see the module); the other properties as they are. The
    library's own headers stay in the clear too, but the traceback (the packed table has it): a listing reads
    them without unpacking anything."""
    new = dict(properties)
    table = dict(new.get("application_headers") or {})
    plain = {k: v for k, v in table.items()
             if k.startswith(wire.PREFIX) and k != wire.TRACEBACK and isinstance(v, _PLAIN)}
    plain[PACKED] = base64.b64encode(dumps("F", [table])).decode("ascii")
    new["application_headers"] = plain
    return new


def unpack(headers: Mapping[str, Any]) -> dict[str, Any]:
    """The header table an archived copy was written with: the packed one when there is one, else ``headers``."""
    packed = headers.get(PACKED)
    if not isinstance(packed, str):
        return {k: v for k, v in headers.items() if k != PACKED}
    table, _ = loads("F", base64.b64decode(packed.encode("ascii"), validate=True), 0)
    return dict(table[0])
