"""What the console's index keeps of one archived copy: the fields its pages show and search, and the first
bytes of the body, never the whole body. Pure.

An :class:`Entry` costs about 2 KiB however large its body (:data:`BODY_PREFIX_BYTES` of body, the exception
and the reason cut to :data:`TEXT_CHARS`): 100,000 archived copies take about 200 MB of the console's memory,
whether their bodies are 1 KiB or 15 MiB. Everything else (headers, properties, traceback, the whole body) is
read from the archive stream at the copy's offset when one event's page asks for it.
"""
from __future__ import annotations

__all__ = ["Entry", "entry_of", "BODY_PREFIX_BYTES", "TEXT_CHARS"]

import sys
from dataclasses import dataclass
from typing import Any

from ..ops.archive import ArchivedMessage
from .query import normalise

#: Body bytes the index keeps of each archived copy: what the failures page and the API list show of a body,
#: and what a search looks at.
BODY_PREFIX_BYTES = 1024
#: Characters of the exception and of the reason the index keeps (the worker archives at most 500 of each).
TEXT_CHARS = 500
_SHORT_CHARS = 255


@dataclass(frozen=True)
class Entry:
    """One archived copy as the index keeps it (``prefix``: the first :data:`BODY_PREFIX_BYTES` of its body)."""

    # Slots by hand (``dataclass(slots=True)`` is 3.10's): the index holds up to the archive's whole length.
    __slots__ = ("archived_at", "attempts", "content_type", "exception", "failure", "id", "key", "offset", "prefix",
                 "queue", "reason", "routing_key", "size")

    key: str
    offset: int
    id: str
    queue: str
    routing_key: str
    reason: str
    exception: str
    archived_at: str
    attempts: int | str | None
    content_type: str
    prefix: bytes
    size: int
    #: The exception (or the reason) normalised, as the failures page groups it (:func:`.query.normalise`).
    failure: str

    @property
    def truncated(self) -> bool:
        """Whether ``prefix`` holds only the first bytes of the body."""
        return len(self.prefix) < self.size

    def summary(self) -> dict[str, Any]:
        """The JSON API's list item: the ``archive-list`` document without traceback, headers and properties
        (``GET /api/archive/KEY`` has them), the body as its first bytes (text, or the repr of the bytes)."""
        try:
            body: str = self.prefix.decode("utf-8")
        except UnicodeDecodeError:
            body = repr(self.prefix)
        return {"key": self.key, "id": self.id, "queue": self.queue, "routing_key": self.routing_key,
                "reason": self.reason, "attempts": self.attempts, "archived_at": self.archived_at,
                "exception": self.exception, "body": body, "size": self.size, "truncated": self.truncated,
                "offset": self.offset}


def _attempts(value: Any) -> int | str | None:
    if value is None or (isinstance(value, int) and not isinstance(value, bool)):
        return value
    return str(value)[:_SHORT_CHARS]  # whatever a foreign publisher put there, short


def _shared(text: Any, limit: int = _SHORT_CHARS) -> str:
    """``text`` cut to ``limit`` and interned: thousands of copies share one queue name or routing key."""
    return sys.intern(str(text)[:limit])


def entry_of(message: ArchivedMessage, *, prefix_bytes: int = BODY_PREFIX_BYTES) -> Entry:
    """The index's entry for ``message`` (its body may already be a prefix: ``size`` is the whole body's)."""
    exception, reason = message.exception[:TEXT_CHARS], message.reason[:TEXT_CHARS]
    return Entry(key=message.key, offset=message.offset, id=message.id, queue=_shared(message.queue),
                 routing_key=_shared(message.routing_key), reason=reason, exception=exception,
                 archived_at=str(message.archived_at)[:64], attempts=_attempts(message.attempts),
                 content_type=_shared(message.properties.get("content_type") or ""),
                 prefix=bytes(message.body[:prefix_bytes]), size=message.size,
                 failure=sys.intern(normalise(exception or reason)))
