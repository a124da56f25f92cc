"""The archive on the broker: list, show, replay, purge -- and no read ever changes it.

The archive is a RabbitMQ stream (``<service>.archive``): append-only, read by offset
(:mod:`kombu_events.broker.streams`). A read counts no delivery, sets no ``redelivered``,
moves and reorders nothing, on RabbitMQ 3.10 and 4.x, whatever the service's queue type.
Every archived copy carries a unique *archive key* (stamped by the worker that archived
it; a copy written without one, by a worker of an earlier version, is keyed by its offset).

Replay and purge remove nothing: they append a *settlement* record naming the keys they
settled (:mod:`kombu_events.core.archive_records`), and every reader folds those in, so
a settled copy is no longer listed. Replay first has every copy confirmed by the broker
(publisher confirms, mandatory), and only then writes the record of those confirmed: a
crash or a lost connection in between leaves them listed, and a replay run again sends
them again, under the same message id (an edited copy's id is derived from its archive
key and its body), which a ``once=True`` handler's inbox drops. A purged copy stays in
the stream, hidden, until retention (``archive_ttl_ms``, ``archive_max_bytes``) removes
its segment; :func:`kombu_events.ops.archive_rewrite.rewrite` removes purged copies for
good (docs/failures.md).
"""
from __future__ import annotations

__all__ = ["ArchivedMessage", "ReplayProgress", "LegacyArchiveError", "ArchiveMissingError", "PREVIEW_BYTES",
           "records", "parse_record", "view", "read", "ArchiveCounter", "archived_count", "browse", "replay",
           "purge", "purge_all", "settle", "message_key", "ORIGINAL_ID", "KEY_PREFIX_UNSTAMPED"]

import hashlib
import logging
import uuid
from collections import deque
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable, Iterator, Mapping

from amqp import Message
from amqp.exceptions import NotFound

from ..broker import stream_headers, streams
from ..broker.confirms import Confirmer
from ..broker.declare import close_quietly, peek_queue
from ..core import archive_records as records_, headers as wire
from ..core.archive_records import Fold, Settlement
from ..core.topology import Topology
from ..errors import KombuEventsError

logger = logging.getLogger(__name__)

#: On an edited copy (``replay(edits=...)``): the message id of the archived original.
ORIGINAL_ID = wire.PREFIX + "original-id"

#: Body bytes a listing keeps of each archived copy (the console's pages; a search looks at these).
PREVIEW_BYTES = 4096

#: The key of a copy archived without one (by an earlier version): ``@`` and its offset.
KEY_PREFIX_UNSTAMPED = "@"

#: Copies a replay sends before it waits for their confirms and writes their settlement.
_REPLAY_WINDOW = 200


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
    fold: Fold[ArchivedMessage] = Fold()
    for record in records(connection, topology, start=start, body_limit=body_limit, full=full):
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
    chosen = _select(view(connection, topology, body_limit=PREVIEW_BYTES if bodies is False else 0, full=False),
                     match, limit)
    if not bodies or not chosen:
        return chosen
    return list(_whole(connection, topology, chosen))


def browse(connection: Any, topology: Topology, limit: int = 100_000) -> list[ArchivedMessage]:
    """The first ``limit`` copies still archived, with the first :data:`PREVIEW_BYTES` of each body."""
    return read(connection, topology, limit=limit, bodies=False)


def _select(fold: Fold[ArchivedMessage], match: Callable[[ArchivedMessage], bool],
            limit: int | None) -> list[ArchivedMessage]:
    if limit is not None and limit <= 0:
        return []
    chosen = []
    for message in fold.pending():
        if match(message):
            chosen.append(message)
            if limit is not None and len(chosen) >= limit:
                break
    return chosen


def _whole(connection: Any, topology: Topology, chosen: list[ArchivedMessage]) -> Iterator[ArchivedMessage]:
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


class ArchiveCounter:
    """How many copies the archive holds (pending: neither replayed nor purged), counted incrementally: each
    :meth:`count` reads only the records appended since the last one, and forgets copies that retention removed
    (those before the stream's first offset). Holds one key and offset per copy, no body; ``bytes`` is the size
    of every record still in the stream (bodies and headers as stored: about what retention by bytes counts)."""

    def __init__(self, topology: Topology) -> None:
        self.topology = topology
        self._reset()

    def _reset(self) -> None:
        self.fold: Fold[int] = Fold()
        self.next_offset = 0
        self.bytes = 0
        self._sizes: deque[tuple[int, int]] = deque()  # (offset, bytes) of every record read, in order
        self._last: tuple[str, ...] | None = None  # what the last record read was (see _identity)

    def count(self, connection: Any) -> int:
        """The copies archived now (see the class)."""
        queue = self.topology.archive_exchange
        first = _first_offset(connection, queue)
        if first is not None and first > self.next_offset:
            self.next_offset = first  # retention removed what was not read yet
        start = self.next_offset
        again = start - 1 if self._last is not None else None  # the last record read: is it still there?
        for record in records(connection, self.topology, start=start if again is None else again, body_limit=0,
                              full=False):
            if again is not None:
                if record.offset < again:
                    continue  # a read from an offset begins with that offset's chunk
                if record.offset != again or _identity(record) != self._last:
                    self._reset()  # the stream was made again (a rewrite): same keys, other offsets
                    return self.count(connection)
                again = None
                continue
            self.next_offset = max(self.next_offset, record.offset + 1)
            if record.offset < start:
                continue  # read again from the start of a chunk
            self._last = _identity(record)
            if isinstance(record, Settlement):
                self.fold.settle(record)
                size = record.size
            else:
                self.fold.add(record.key, record.offset)
                size = record.size + record.stored_header_bytes
            self._sizes.append((record.offset, size))
            self.bytes += size
        if again is not None:  # the last record read is not there any more: the stream was made again
            self._reset()
            return self.count(connection)
        while self._sizes and first is not None and self._sizes[0][0] < first:
            self.bytes -= self._sizes.popleft()[1]
        if first is not None:  # retention removed them: forget them (settlements older than a copy are too)
            for key in [k for k, offset in self.fold.copies.items() if offset < first]:
                del self.fold.copies[key]
            for key in [k for k, settlement in self.fold.settled.items() if settlement.offset < first]:
                del self.fold.settled[key]
        return len(self.fold.copies)


def _identity(record: ArchivedMessage | Settlement) -> tuple[str, ...]:
    """What tells a record apart once offsets may have changed: a copy's key, a settlement's action, time, keys."""
    if isinstance(record, Settlement):
        return (record.action, record.at, *record.keys)
    return (record.key,)


def _first_offset(connection: Any, queue: str) -> int | None:
    """The offset of the first record still in stream ``queue`` (None: empty)."""
    try:
        for offset, _ in streams.read(connection, queue, start="first", settle_s=0.0):
            return offset
    except (NotFound, streams.NotAStreamError):
        return None  # records() says why, with the words for it
    return None


def archived_count(connection: Any, topology: Topology) -> int:
    """Copies in the archive now (pending), read from the whole stream (body bytes not kept)."""
    return ArchiveCounter(topology).count(connection)


@dataclass
class ReplayProgress:
    """What one replay did, counted across connections (the console's job shows it)."""

    #: Copies confirmed by the broker and settled, over every connection.
    copies_confirmed: int = 0
    #: Settlement records written, over every connection.
    commits: int = 0
    #: Archive keys settled so far (a replay run again after a lost connection skips them).
    settled: set[str] = field(default_factory=set)


def replay(connection: Any, topology: Topology, match: Callable[[ArchivedMessage], bool],
           limit: int | None = None, *, to_queue: str | None = None, stamp: Mapping[str, Any] | None = None,
           edits: Mapping[str, bytes] | None = None, progress: ReplayProgress | None = None,
           by: str | None = None, window: int = _REPLAY_WINDOW, confirm_timeout_s: float = 30.0,
           match_body: int = 0, start: int | str = "first",
           on_window: Callable[[list[ArchivedMessage]], Any] | None = None,
           ) -> tuple[list[ArchivedMessage], list[tuple[ArchivedMessage, str]]]:
    """Replay the archived copies that ``match`` (at most ``limit``) to their queues; (replayed, [(kept, why)]).

    ``to_queue``: every copy to this handler queue instead; ``stamp``: headers added to every copy (the
    console's audit trail); ``edits``: archive key -> the body its copy carries instead, under a message id
    derived from the key and that body, the original's id in the ``kombu-events-original-id`` header;
    ``match_body``: how many bytes of each body ``match`` sees (none by default: the selection holds no body);
    ``start``: the offset to read from (the smallest of the copies wanted: a settlement always comes after the
    copies it names, so nothing before it can matter); ``on_window``: called with each window's copies once
    they are settled (a caller's moment to keep to a rate, or to stop by raising).

    Each copy goes to its queue through the service's delivery exchange, mandatory, with publisher
    confirms; a window of copies confirmed is settled by one ``replayed`` record, itself confirmed, before
    the next window. A copy the broker returns (its queue was deleted) or nacks stays archived, with why.
    A lost connection raises (py-amqp's or the socket's error): what was confirmed and not settled is sent
    again by the next replay, under the same message id (see the module). Nothing leaves the archive.
    """
    chosen = _select(view(connection, topology, body_limit=match_body, full=False, start=start), match, limit)
    if progress is not None:
        chosen = [m for m in chosen if m.key not in progress.settled]
    replayed: list[ArchivedMessage] = []
    kept: list[tuple[ArchivedMessage, str]] = []
    handler_queues = {q.name for q in topology.queues if topology.role(q.name) in ("handler", "schedule")}
    why_not: dict[str, str | None] = {}
    sendable = []
    for message in chosen:
        queue = to_queue or message.queue
        if queue not in why_not:
            why_not[queue] = _unsendable(connection, queue, handler_queues)
        reason = why_not[queue]
        if reason is None:
            sendable.append(message)
        else:
            kept.append((message, reason))
    if not sendable:
        return replayed, kept
    sender = _Sender(connection, topology, to_queue, dict(stamp or {}), edits, by, confirm_timeout_s, on_window)
    try:
        batch: list[ArchivedMessage] = []
        for message in _whole(connection, topology, sendable):
            batch.append(message)
            if len(batch) >= window:
                sender.send(batch, replayed, kept, progress)
                batch = []
        if batch:
            sender.send(batch, replayed, kept, progress)
    finally:
        sender.close()
    replayed.sort(key=lambda m: m.offset)
    return replayed, kept


def _unsendable(connection: Any, queue: str, handler_queues: set[str]) -> str | None:
    """Why a copy cannot be sent to ``queue`` (not this service's, or not on the broker), else None."""
    if queue not in handler_queues:
        return f"queue {queue!r} is not a queue of this service"
    if peek_queue(connection, queue) is None:
        return f"queue {queue!r} does not exist on the broker (declare it, or replay to another queue)"
    return None


class _Sender:
    """Publishes replayed copies and settlement records on one confirm channel."""

    def __init__(self, connection: Any, topology: Topology, to_queue: str | None, stamp: dict[str, Any],
                 edits: Mapping[str, bytes] | None, by: str | None, timeout_s: float,
                 on_window: Callable[[list[ArchivedMessage]], Any] | None = None) -> None:
        self.topology, self.to_queue, self.stamp, self.edits = topology, to_queue, stamp, edits
        self.on_window = on_window
        self.userid = getattr(connection, "userid", None)
        self.by = by or self.userid or ""
        self.timeout_s = timeout_s
        self.channel = connection.channel()
        self.confirmer = Confirmer(self.channel)

    def close(self) -> None:
        close_quietly(self.channel)

    def copy_of(self, message: ArchivedMessage) -> tuple[bytes, dict[str, Any]]:
        """Body and properties of ``message``'s copy; an edited one under an id derived from key and body."""
        headers = {**wire.replay_headers(message.headers, archive_key=message.key), **self.stamp}
        edited = self.edits.get(message.key) if self.edits is not None else None
        if edited is not None:
            headers[ORIGINAL_ID] = message.id
        properties = wire.republish_properties(message.properties, headers, userid=self.userid)
        if edited is None:
            return message.body, properties
        digest = hashlib.sha256(message.key.encode() + b"\0" + edited).hexdigest()
        properties["message_id"] = str(uuid.uuid5(uuid.NAMESPACE_URL, f"kombu-events:edit:{digest}"))
        return edited, properties

    def send(self, batch: list[ArchivedMessage], replayed: list[ArchivedMessage],
             kept: list[tuple[ArchivedMessage, str]], progress: ReplayProgress | None) -> None:
        """Publish ``batch``'s copies, wait for their confirms, then settle those confirmed (one record)."""
        confirmed: list[tuple[ArchivedMessage, str]] = []
        for message in batch:
            queue = self.to_queue or message.queue
            body, properties = self.copy_of(message)
            address = self.topology.address(queue, 0)
            self.confirmer.publish(Message(body, **properties), address.exchange, address.routing_key,
                                   on_ok=partial(confirmed.append, (message, queue)),
                                   on_fail=partial(_kept_because, kept, message))
        self._wait("the replayed copies")
        if not confirmed:
            return
        keys = [m.key for m, _ in confirmed]
        body, properties = records_.settlement_record(records_.REPLAYED, keys, by=self.by,
                                                      detail={m.key: q for m, q in confirmed})
        failed: list[str] = []
        self.confirmer.publish(Message(body, **properties), self.topology.archive_exchange, "",
                               on_ok=lambda: None, on_fail=failed.append)
        self._wait("the settlement record")
        if failed:
            raise KombuEventsError(f"the broker did not take the settlement record of {len(keys)} replayed "
                                   f"copies ({failed[0]}): they were delivered and are still listed; a replay run "
                                   "again sends them again, under the same message ids")
        replayed.extend(m for m, _ in confirmed)
        if progress is not None:
            progress.copies_confirmed += len(confirmed)
            progress.commits += 1
            progress.settled.update(keys)
        logger.info("kombu-events: replayed %d archived cop%s of %s (settled by %s)", len(keys),
                    "y" if len(keys) == 1 else "ies", self.topology.settings.service, self.by or "?")
        if self.on_window is not None:
            self.on_window([m for m, _ in confirmed])

    def _wait(self, what: str) -> None:
        self.confirmer.wait(timeout_s=self.timeout_s, reraise=True)  # a lost connection raises as itself
        if self.confirmer.pending:
            raise KombuEventsError(f"the broker confirmed none of {what} in {self.timeout_s:g} s "
                                   f"({self.confirmer.pending} waiting); nothing was settled")


def _kept_because(kept: list[tuple[ArchivedMessage, str]], message: ArchivedMessage, why: str) -> None:
    kept.append((message, f"copy {why}; kept archived"))


def purge(connection: Any, topology: Topology, match: Callable[[ArchivedMessage], bool],
          limit: int | None = None, *, by: str | None = None, note: str = "", match_body: int = 0,
          start: int | str = "first") -> list[ArchivedMessage]:
    """Settle the archived copies that ``match`` (the first ``limit``) as purged; return them.

    They are no longer listed by any reader; they stay in the stream until retention removes their segment
    (:func:`kombu_events.ops.archive_rewrite.rewrite` removes them for good). The records are confirmed
    before this returns; each names its keys, who purged and when (the audit of the purge). ``match`` sees
    the first ``match_body`` bytes of each body (none by default); ``start``: as for :func:`replay`.
    """
    chosen = _select(view(connection, topology, body_limit=match_body, full=False, start=start), match, limit)
    settle(connection, topology, records_.PURGED, [m.key for m in chosen], by=by, note=note)
    return chosen


def purge_all(connection: Any, topology: Topology, *, by: str | None = None) -> int:
    """Settle every archived copy as purged; return how many."""
    return len(purge(connection, topology, lambda m: True, by=by, note="purge of the whole archive"))


def settle(connection: Any, topology: Topology, action: str, keys: list[str], *, by: str | None = None,
           note: str = "", timeout_s: float = 30.0) -> None:
    """Append settlement records for ``keys`` (at most :data:`MAX_KEYS_PER_RECORD` each), confirmed."""
    if not keys and action != records_.OPENED:
        return
    channel = connection.channel()
    try:
        confirmer = Confirmer(channel)
        failed: list[str] = []
        who = by or getattr(connection, "userid", None) or ""
        step = records_.MAX_KEYS_PER_RECORD
        for start in range(0, max(len(keys), 1), step):
            body, properties = records_.settlement_record(action, keys[start:start + step], by=who, note=note)
            confirmer.publish(Message(body, **properties), topology.archive_exchange, "", on_ok=lambda: None,
                              on_fail=failed.append)
        confirmer.wait(timeout_s=timeout_s)
        if failed or confirmer.pending:
            raise KombuEventsError(f"the broker did not take the {action} record(s) of {len(keys)} archived "
                                   f"cop{'y' if len(keys) == 1 else 'ies'}: {failed[0] if failed else 'no confirm'}; "
                                   "nothing was settled that the broker did not confirm")
    finally:
        close_quietly(channel)
    if keys:
        logger.info("kombu-events: %s %d archived cop%s of %s (by %s)%s", action, len(keys),
                    "y" if len(keys) == 1 else "ies", topology.settings.service, who or "?",
                    f": {note}" if note else "")


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

