"""Reading the archive stream: each record parsed (an archived copy or a settlement), folded, selected.

A read changes nothing in the archive (see :mod:`kombu_events.ops.archive`, which also re-exports the
public names of this module).
"""
from __future__ import annotations

__all__ = ["ArchivedMessage", "LegacyArchiveError", "ArchiveMissingError", "PREVIEW_BYTES", "KEY_PREFIX_UNSTAMPED",
           "message_key", "parse_record", "records", "view", "read", "selected", "browse", "pending_matching",
           "whole_copies"]

import hashlib
import logging
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Mapping

from amqp.exceptions import NotFound

from ..broker import stream_headers, streams
from ..core import archive_records as records_, wire
from ..core.archive_records import Fold, Settlement
from ..core.topology import Topology
from ..errors import KombuEventsError

logger = logging.getLogger(__name__)

#: Body bytes a listing keeps of each archived copy (the console's pages; a search looks at these).
PREVIEW_BYTES = 4096

#: The key of a copy archived without one (by an earlier version): ``@`` and its offset.
KEY_PREFIX_UNSTAMPED = "@"


class LegacyArchiveError(KombuEventsError):
    """The archive is a queue of an earlier version (classic or quorum), not a stream: migrate it first."""


class ArchiveMissingError(KombuEventsError):
    """The service's archive does not exist on the broker (not declared yet)."""


@dataclass
class ArchivedMessage:
    """One archived copy as read from the archive stream (``body``: all of it, or its first bytes)."""

    key: str
    offset: int
    id: str
    queue: str
    routing_key: str
    reason: str
    attempts: Any
    archived_at: str
    exception: str
    traceback: str
    headers: dict[str, Any]
    properties: dict[str, Any]
    body: bytes
    size: int
    #: Bytes of the header table as stored (packed, with the library's own in the clear).
    stored_header_bytes: int = 0
    #: Read for a listing: no ``headers``, ``properties`` but the message id, no ``traceback`` (see :func:`view`).
    partial: bool = False

    @property
    def truncated(self) -> bool:
        """Whether ``body`` holds only the first bytes of the archived body."""
        return len(self.body) < self.size

    def summary(self) -> dict[str, Any]:
        """JSON-friendly fields (body as text when it decodes)."""
        try:
            body: Any = self.body.decode("utf-8")
        except UnicodeDecodeError:
            body = repr(self.body)
        return {"key": self.key, "id": self.id, "queue": self.queue, "routing_key": self.routing_key,
                "reason": self.reason, "attempts": _jsonable(self.attempts), "archived_at": self.archived_at,
                "exception": self.exception, "traceback": self.traceback, "headers": _jsonable(self.headers),
                "properties": _jsonable({k: v for k, v in self.properties.items() if k != "application_headers"}),
                "body": body, "size": self.size, "truncated": self.truncated, "offset": self.offset}


def message_key(properties: Mapping[str, Any], body: bytes, headers: Mapping[str, Any]) -> str:
    """The message id, or a stable digest when the publisher set none."""
    if properties.get("message_id"):
        return str(properties["message_id"])
    digest = hashlib.sha1(body + str(headers.get(wire.ARCHIVED_AT, "")).encode()).hexdigest()
    return f"sha1:{digest[:16]}"


def parse_record(offset: int, msg: Any, body_limit: int | None = None, full: bool = True,
                 ) -> ArchivedMessage | Settlement:
    """One record read from the archive stream at ``offset``: an archived copy or a settlement (see
    :func:`records` for ``body_limit`` and ``full``)."""
    body = streams.body_of(msg)
    stored = msg.properties.get("application_headers") or {}
    if records_.is_settlement(stored):
        settlement = records_.parse_settlement(stored, body, offset)
        if settlement is not None:
            return settlement
    plain = {k: v for k, v in stored.items() if not k.startswith("x-stream")}
    h = stream_headers.unpack(plain) if full else plain
    key = h.get(wire.ARCHIVE_KEY)
    if full or stream_headers.PACKED not in plain:
        properties = {k: v for k, v in msg.properties.items() if k != "application_headers"}
        properties["application_headers"] = h
    else:  # partial: what a listing shows, a few hundred bytes a copy
        properties = {"message_id": msg.properties.get("message_id")}
    return ArchivedMessage(
        key=str(key) if key else f"{KEY_PREFIX_UNSTAMPED}{offset}", offset=offset,
        id=message_key(properties, body, h), queue=str(h.get(wire.QUEUE, "")),
        routing_key=str(h.get(wire.ROUTING_KEY, msg.delivery_info.get("routing_key", ""))),
        reason=str(h.get(wire.REASON, "")), attempts=h.get(wire.ATTEMPTS), archived_at=str(h.get(wire.ARCHIVED_AT, "")),
        exception=str(h.get(wire.EXCEPTION, "")), traceback=str(h.get(wire.TRACEBACK, "")),
        headers=h if properties.get("application_headers") is h else {}, properties=properties,
        body=body if body_limit is None else body[:body_limit], size=len(body),
        stored_header_bytes=sum(len(str(k)) + len(v if isinstance(v, (str, bytes)) else str(v))
                                for k, v in stored.items()),
        partial=not full and stream_headers.PACKED in plain)


def records(connection: Any, topology: Topology, *, start: int | str = "first", body_limit: int | None = None,
            full: bool = True) -> Iterator[ArchivedMessage | Settlement]:
    """Every record of the archive from ``start`` to its end when the read began, in order: archived copies
    (``body_limit``: their first bytes only; ``full=False``: the library's own headers only, nothing unpacked)
    and settlements. A read changes nothing in the archive.

    Raises ArchiveMissingError for an archive not declared, LegacyArchiveError for one that is not a stream.
    """
    queue = topology.archive_exchange
    try:
        for offset, msg in streams.read(connection, queue, start=start):
            yield parse_record(offset, msg, body_limit, full)
    except NotFound as exc:
        raise ArchiveMissingError(f"the archive {queue!r} does not exist on the broker: declare the topology "
                                  "(`kombu-events declare`, or start a worker)") from exc
    except streams.NotAStreamError as exc:
        raise LegacyArchiveError(
            f"the archive {queue!r} is a queue of an earlier kombu-events version, not a stream: reading it would "
            "change it. Move it to a stream, its messages with it: `kombu-events migrate --archive` "
            "(docs/rabbitmq-versions.md)") from exc


def view(connection: Any, topology: Topology, *, body_limit: int | None = PREVIEW_BYTES,
         start: int | str = "first", full: bool = True) -> Fold[ArchivedMessage]:
    """The whole archive folded: copies by key, settlements applied (``pending()``: what is still archived).
    ``full=False``: each copy with the library's headers only (``partial``), for a listing or a selection."""
    return _folded(records(connection, topology, start=start, body_limit=body_limit, full=full))


def view_through(connection: Any, topology: Topology, *, body_limit: int | None = PREVIEW_BYTES,
                 start: int | str = "first", full: bool = True) -> tuple[Fold[ArchivedMessage], int | None]:
    """:func:`view`, and the last offset its read reached (None: it read nothing)."""
    reached: list[int] = []

    def noting(found: Iterable[ArchivedMessage | Settlement]) -> Iterator[ArchivedMessage | Settlement]:
        for record in found:
            reached[:] = [record.offset]
            yield record

    fold = _folded(noting(records(connection, topology, start=start, body_limit=body_limit, full=full)))
    return fold, reached[0] if reached else None


def _folded(found: Iterable[ArchivedMessage | Settlement]) -> Fold[ArchivedMessage]:
    fold: Fold[ArchivedMessage] = Fold()
    for record in found:
        if isinstance(record, Settlement):
            fold.settle(record)
        else:
            fold.add(record.key, record)
    return fold


def read(connection: Any, topology: Topology, match: Callable[[ArchivedMessage], bool] = lambda m: True,
         limit: int | None = None, *, bodies: bool = True) -> list[ArchivedMessage]:
    """The archived copies still archived that ``match`` (at most ``limit``, oldest first), whole: body, every
    header, traceback (``bodies=False``: ``partial`` ones, the first :data:`PREVIEW_BYTES` of the body and the
    library's own headers, as a listing needs). ``match`` sees a partial copy (no body with ``bodies=True``).
    Changes nothing."""
    chosen = pending_matching(view(connection, topology, body_limit=PREVIEW_BYTES if bodies is False else 0,
                                   full=False), match, limit)
    if not bodies or not chosen:
        return chosen
    return list(whole_copies(connection, topology, chosen))


def selected(connection: Any, topology: Topology, match: Callable[[ArchivedMessage], bool] = lambda m: True,
             limit: int | None = None) -> tuple[list[ArchivedMessage], int | None]:
    """What a dry run shows: the copies still archived that ``match`` (at most ``limit``, partial, as
    ``read(bodies=False)`` has them) and the offset that pins exactly that set (``--through``): the last offset
    the read reached, or the last copy's when ``limit`` cut the selection short; None for an empty stream.

    A copy archived later has a greater offset, so ``match`` narrowed to ``offset <= through`` selects these
    copies and no other (fewer, when some are settled meanwhile) -- until a rewrite gives every copy a new
    offset. Changes nothing."""
    fold, reached = view_through(connection, topology, body_limit=PREVIEW_BYTES, full=False)
    chosen = pending_matching(fold, match, limit)
    if limit is not None and chosen and len(chosen) >= limit:
        return chosen, chosen[-1].offset
    return chosen, reached


def browse(connection: Any, topology: Topology, limit: int = 100_000) -> list[ArchivedMessage]:
    """The first ``limit`` copies still archived, with the first :data:`PREVIEW_BYTES` of each body."""
    return read(connection, topology, limit=limit, bodies=False)


def pending_matching(fold: Fold[ArchivedMessage], match: Callable[[ArchivedMessage], bool],
                     limit: int | None) -> list[ArchivedMessage]:
    """The copies of ``fold`` still archived that ``match``, the first ``limit`` of them, in stream order."""
    if limit is not None and limit <= 0:
        return []
    chosen = []
    for message in fold.pending():
        if match(message):
            chosen.append(message)
            if limit is not None and len(chosen) >= limit:
                break
    return chosen


def whole_copies(connection: Any, topology: Topology, chosen: list[ArchivedMessage]) -> Iterator[ArchivedMessage]:
    """``chosen`` (previews, in stream order) read again whole, from the first one's offset, one at a time."""
    wanted = {m.key: m for m in chosen}
    if all(not (m.truncated or m.partial) for m in chosen):
        yield from chosen
        return
    for record in records(connection, topology, start=min(m.offset for m in chosen)):
        if isinstance(record, ArchivedMessage) and record.key in wanted and record.offset == wanted[record.key].offset:
            yield record
            del wanted[record.key]
            if not wanted:
                return
    yield from wanted.values()  # gone meanwhile (retention): its preview is all there is


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return str(value)
