"""How an archived message's id travels through the console's links and forms, whatever it holds. Pure.

An id is whatever its publisher set as ``message_id``: ``/``, ``?``, ``#``, ``%``, spaces, newlines,
any script. In a link it is one path segment, percent-encoded, ``/`` included, so ``../../audit`` stays
one segment of ``/events/``; the ids ``.`` and ``..`` go in the query instead (``/events?id=..``),
since a browser resolves such a segment away, percent-encoded or not. In a form field it is
percent-encoded too: a browser turns every newline of a field it submits into CRLF, and its HTML parser
every CR into LF, so an id sent as it is could come back another.
"""
from __future__ import annotations

__all__ = ["id_segment", "to_field", "from_field"]

from urllib.parse import quote, unquote

#: Path segments a browser removes from a URL (``%2e`` is a dot to it too): no id goes in a path as one.
_DOT_SEGMENTS = frozenset({".", ".."})


def id_segment(message_id: str) -> str | None:
    """``message_id`` as one path segment, percent-encoded; None for an id that must go in the query."""
    return None if message_id in _DOT_SEGMENTS else quote(message_id, safe="")


def to_field(message_id: str) -> str:
    """The value of a form field that carries ``message_id`` (read back with :func:`from_field`)."""
    return quote(message_id, safe="")


def from_field(value: str) -> str:
    """The id a form field made by :func:`to_field` carries."""
    return unquote(value)
