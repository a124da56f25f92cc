"""The records of the archive stream besides archived messages, and how a reader folds them in; no I/O.

The archive is append-only (a RabbitMQ stream): replaying or purging an archived copy
removes nothing, it appends a *settlement* record that names the copies by archive key.
A reader folds every record it read into an :class:`Archive` view: the copies still
archived (pending), and for each settled one, how and when. The first record of a
stream its declare created is an ``opened`` settlement naming no copy: the archive is
never empty, so a reader always finds its end (docs/failures.md).
"""
from __future__ import annotations

__all__ = ["Settlement", "ACTIONS", "OPENED", "REPLAYED", "PURGED", "settlement_record", "parse_settlement",
           "MAX_KEYS_PER_RECORD", "Fold", "is_settlement"]

import json
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Generic, Iterable, Mapping, TypeVar

from . import wire

OPENED = "opened"
REPLAYED = "replayed"
PURGED = "purged"
ACTIONS = (OPENED, REPLAYED, PURGED)

#: Archive keys one settlement record names at most (a larger purge writes several records).
MAX_KEYS_PER_RECORD = 1000


@dataclass(frozen=True)
class Settlement:
    """One settlement record: ``action`` on the archived copies ``keys``, by ``by`` at ``at``."""

    action: str
    keys: tuple[str, ...]
    by: str
    at: str
    note: str = ""
    #: Per key, what the action did with it (a replay: the queue its copy went to).
    detail: Mapping[str, str] = field(default_factory=dict)
    offset: int = -1
    #: Bytes of the record's body.
    size: int = 0


def settlement_record(action: str, keys: Iterable[str], *, by: str | None, note: str = "",
                      detail: Mapping[str, str] | None = None) -> tuple[bytes, dict[str, Any]]:
    """Body and properties of a settlement record (JSON; the action in the :data:`~.headers.SETTLEMENT` header)."""
    if action not in ACTIONS:
        raise ValueError(f"unknown settlement action {action!r}")
    at = datetime.now(timezone.utc).isoformat(timespec="milliseconds")
    body = json.dumps({"action": action, "keys": list(keys), "by": by or "", "at": at, "note": note,
                       "detail": dict(detail or {})}, separators=(",", ":")).encode()
    return body, {"content_type": "application/json", "delivery_mode": 2,
                  "application_headers": {wire.SETTLEMENT: action}}


def is_settlement(headers: Mapping[str, Any]) -> bool:
    """Whether a record with these (stored) headers is a settlement: it says so, and carries nothing of an
    archived copy (a publisher's own settlement header on a copy an earlier version archived settles nothing)."""
    return wire.SETTLEMENT in headers and not any(
        name in headers for name in (wire.ARCHIVE_KEY, wire.ARCHIVED_AT, wire.PACKED_HEADERS))


def parse_settlement(headers: Mapping[str, Any], body: bytes, offset: int) -> Settlement | None:
    """The settlement a record holds, or None when it is an archived message (no settlement header).

    A settlement header with a body that is not one (a publisher imitating it) settles nothing.
    """
    action = headers.get(wire.SETTLEMENT)
    if action is None:
        return None
    try:
        data = json.loads(body)
        keys = tuple(str(k) for k in data.get("keys", ()))
        detail = {str(k): str(v) for k, v in dict(data.get("detail") or {}).items()}
        return Settlement(str(data.get("action", action)), keys, str(data.get("by", "")), str(data.get("at", "")),
                          str(data.get("note", "")), detail, offset, len(body))
    except (ValueError, TypeError, AttributeError):
        return Settlement(str(action), (), "", "", "unreadable settlement record", {}, offset, len(body))


_Copy = TypeVar("_Copy")


class Fold(Generic[_Copy]):
    """Archived copies by key, in stream order, and the settlements read so far.

    ``add`` an archived copy (the first record of a key counts: a copy written twice, by a migration
    or a rewrite, is one), ``settle`` a settlement; ``copies`` holds only the copies no settlement names
    (a settled copy is dropped, its key kept in ``settled``), so a fold's memory follows what is pending.
    """

    def __init__(self) -> None:
        self.copies: dict[str, _Copy] = {}
        self.settled: dict[str, Settlement] = {}
        self.settlements = 0

    def add(self, key: str, copy: _Copy) -> bool:
        """Keep ``copy`` under ``key`` unless a copy of that key was read or settled before; whether it was kept."""
        if key in self.copies or key in self.settled:
            return False
        self.copies[key] = copy
        return True

    def settle(self, settlement: Settlement) -> None:
        """Fold in ``settlement``: each key it names is settled (the first settlement of a key counts)."""
        self.settlements += 1
        for key in settlement.keys:
            if key not in self.settled:
                self.settled[key] = settlement
                self.copies.pop(key, None)

    def is_pending(self, key: str) -> bool:
        """Whether the copy ``key`` was read and no settlement names it."""
        return key in self.copies

    def pending(self) -> list[_Copy]:
        """The copies still archived, in stream order."""
        return list(self.copies.values())
