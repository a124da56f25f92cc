"""How an archive key (or a message id) travels through the console's links and forms, whatever it holds. Pure.

A worker stamps 20 hex digits as an archive key, but a record written into the archive by anyone else may
hold anything in that header, as a message id may: ``/``, ``?``, ``#``, ``%``, spaces, newlines, any
script. In a link it is one path segment, percent-encoded, ``/`` included, so ``../../audit`` stays one
segment of ``/events/``; ``.`` and ``..`` go in the query instead (``/events?key=..``), since a browser
resolves such a segment away, percent-encoded or not. In a form field it is percent-encoded too: a
browser turns every newline of a field it submits into CRLF, and its HTML parser every CR into LF, so a
value sent as it is could come back another.
"""
from __future__ import annotations

__all__ = ["id_segment", "to_field", "from_field"]

from urllib.parse import quote, unquote

#: Path segments a browser removes from a URL (``%2e`` is a dot to it too): no id goes in a path as one.
_DOT_SEGMENTS = frozenset({".", ".."})


def id_segment(key: str) -> str | None:
    """``key`` as one path segment, percent-encoded; None for a key that must go in the query."""
    return None if key in _DOT_SEGMENTS else quote(key, safe="")


def to_field(key: str) -> str:
    """The value of a form field (or of a query parameter) that carries ``key`` (read back with
    :func:`from_field`)."""
    return quote(key, safe="")


def from_field(value: str) -> str:
    """The key a form field made by :func:`to_field` carries."""
    return unquote(value)
