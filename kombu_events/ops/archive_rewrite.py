"""Rewrite the archive stream without its purged copies: removed for good (personal data), keys kept.

A RabbitMQ stream cannot delete one message, so :func:`rewrite` copies the archive
into a temporary stream ``<service>.archive.rewrite`` without the erased copies (those
a ``purged`` settlement names, and ``erase_keys``; their keys leave every settlement
record too), deletes the archive, declares it again and copies everything back.
Archive keys never change (a copy an earlier version wrote without one is stamped
with the key readers knew it by, ``@<offset>``); offsets do.

Each copy from a stream ``S`` to a stream ``T`` is a :func:`transfer`: ``S`` bound
to the archive exchange and ``T`` not, copy ``S`` to its end, bind ``T``, unbind
``S``, then copy what reached ``S`` meanwhile, skipping what reached ``T`` too (by
archive key, or by content for a copy without one). Workers archiving meanwhile lose
nothing: one of the two is always bound. What readers see: the whole archive until
it is deleted; then, until the copy back ends (about 0.7 s per 1,000 records),
``ArchiveMissingError`` or a partial archive. A rewrite that died anywhere is
finished by running it again (the temporary stream is copied back first).
"""
from __future__ import annotations

__all__ = ["rewrite", "transfer", "Seen", "StreamWriter", "content_digest",
           "REWRITE_SUFFIX", "RewriteError"]

import hashlib
import json
import logging
import time
from typing import Any, Callable, Iterable, Mapping

from amqp import Message
from amqp.exceptions import NotFound
from kombu import Queue

from ..broker import streams
from ..broker.confirms import Confirmer
from ..broker.declare import close_quietly, peek_queue
from ..core import archive_records as records_, wire
from ..core.topology import Topology
from ..errors import KombuEventsError
from .archive import ArchivedMessage, records

logger = logging.getLogger(__name__)

REWRITE_SUFFIX = ".rewrite"
#: Seconds after a switch of bindings before the target is read (a publish routed to both is committed by then).
SETTLE_S = 1.0
_WINDOW = 200


class RewriteError(KombuEventsError):
    """The broker did not confirm a copy: nothing was removed, run the rewrite again."""


def content_digest(headers: Mapping[str, Any], properties: Mapping[str, Any], body: bytes) -> bytes:
    """What tells two records apart when they carry no archive key: body, message id, archived-at and the
    settlement action (values a stream keeps as they were sent)."""
    parts = [bytes(body), str(properties.get("message_id") or "").encode(),
             str(headers.get(wire.ARCHIVED_AT) or "").encode(), str(headers.get(wire.SETTLEMENT) or "").encode()]
    return hashlib.sha256(b"\0".join(parts)).digest()[:16]


class Seen:
    """Records already in a target: a copy with an archive key is there when its key is; one without, when
    a record of the same content is (a copy stamped on its way in is known by both)."""

    def __init__(self) -> None:
        self.keys: set[str] = set()
        self.digests: set[bytes] = set()

    def add(self, headers: Mapping[str, Any], properties: Mapping[str, Any], body: bytes) -> None:
        """Remember a record of the target."""
        if headers.get(wire.ARCHIVE_KEY):
            self.keys.add(str(headers[wire.ARCHIVE_KEY]))
        self.digests.add(content_digest(headers, properties, body))

    def has(self, headers: Mapping[str, Any], properties: Mapping[str, Any], body: bytes) -> bool:
        """Whether the record (as found in the source) is already in the target."""
        if headers.get(wire.ARCHIVE_KEY):
            return str(headers[wire.ARCHIVE_KEY]) in self.keys
        return content_digest(headers, properties, body) in self.digests

    def read(self, connection: Any, stream: str, start: int | str = "first") -> int:
        """Remember every record of ``stream`` from ``start`` to its end; the last offset read (-1: none)."""
        last = -1
        for offset, message in streams.read(connection, stream, start=start):
            self.add(_headers(message), message.properties, streams.body_of(message))
            last = offset
        return last


def _headers(message: Any) -> dict[str, Any]:
    return {k: v for k, v in (message.properties.get("application_headers") or {}).items()
            if not k.startswith("x-stream")}


class StreamWriter:
    """Publishes records into one stream (default exchange, mandatory, confirmed), a window at a time."""

    def __init__(self, connection: Any, stream: str, *, timeout_s: float = 60.0) -> None:
        self.stream, self.timeout_s = stream, timeout_s
        self.channel = connection.channel()
        self.confirmer = Confirmer(self.channel)
        self.failures: list[str] = []
        self.written = 0

    def put(self, body: bytes, properties: dict[str, Any], on_ok: Callable[[], Any] = lambda: None) -> None:
        """Publish one record; ``on_ok`` runs once the broker confirms it. A full window is waited for."""
        self.confirmer.publish(Message(body, **properties), "", self.stream, on_ok=on_ok,
                               on_fail=self.failures.append)
        self.written += 1
        if self.confirmer.pending >= _WINDOW:
            self.flush()

    def flush(self) -> None:
        """Wait for every confirm; raise RewriteError if one failed or none came in ``timeout_s``."""
        self.confirmer.wait(timeout_s=self.timeout_s)
        if self.failures or self.confirmer.pending:
            raise RewriteError(f"the broker did not confirm a record written to {self.stream} "
                               f"({self.failures[0] if self.failures else 'no confirm'}): nothing was removed, "
                               "run the command again")

    def close(self) -> None:
        close_quietly(self.channel)


Keep = Callable[[int, dict[str, Any], Any], "tuple[bytes, dict[str, Any]] | None"]


def _copy_stream(connection: Any, source: str, writer: StreamWriter, seen: Seen, keep: Keep,
                 start: int | str, counts: dict[str, int]) -> int:
    """Copy ``source`` from ``start`` to its end into the writer's stream (what ``keep`` keeps, as it returns
    it; what ``seen`` has is skipped); the last offset read."""
    last = start - 1 if isinstance(start, int) else -1
    # Every record, or an error: the source is deleted after the copy (a read that took retention for the end
    # of the stream would lose what it did not copy).
    for offset, message in streams.read(connection, source, start=start, end_if_emptied=False):
        last = offset
        headers = _headers(message)
        counts["read"] += 1
        if seen.has(headers, message.properties, streams.body_of(message)):
            counts["duplicates"] += 1
            continue
        kept = keep(offset, headers, message)
        if kept is None:
            counts["erased"] += 1
            continue
        body, properties = kept
        seen.add(properties.get("application_headers") or {}, properties, body)
        writer.put(body, properties)
    writer.flush()
    return last


def transfer(connection: Any, source: str, target: str, exchange: str, keep: Keep) -> dict[str, int]:
    """Copy stream ``source`` into stream ``target`` and move the archive exchange's binding to ``target``
    (see the module); counts of records read, skipped as already there, and dropped by ``keep``."""
    counts = {"read": 0, "duplicates": 0, "erased": 0}
    channel = connection.channel()
    try:
        channel.queue_bind(source, exchange=exchange, routing_key="")  # one of the two bound, always
        channel.queue_unbind(target, exchange=exchange, routing_key="")
        seen = Seen()
        seen.read(connection, target)
        writer = StreamWriter(connection, target)
        try:
            last = _copy_stream(connection, source, writer, seen, keep, "first", counts)
            mark = streams.last_chunk_offset(connection, target, wait_s=1.0)  # what follows came at the switch
            channel.queue_bind(target, exchange=exchange, routing_key="")
            channel.queue_unbind(source, exchange=exchange, routing_key="")
            time.sleep(SETTLE_S)
            seen.read(connection, target, start="first" if mark is None else mark)
            _copy_stream(connection, source, writer, seen, keep, last + 1, counts)
        finally:
            writer.close()
    finally:
        close_quietly(channel)
    return counts


def rewrite(connection: Any, topology: Topology, *, erase_keys: Iterable[str] | None = None,
            always: bool = False) -> dict[str, int]:
    """Remove for good the archived copies settled as purged (and those of ``erase_keys``); counts.

    ``erased``: copies removed; ``records``: records written back; ``duplicates``: records met twice (the
    same record reached both streams at a switch) and written once. A rewrite of nothing to erase
    changes nothing, unless ``always`` (the archive made again with the topology's arguments: its
    retention). Raises RewriteError when the broker refuses a copy (nothing lost: run it again).
    """
    archive, temporary = topology.archive_exchange, topology.archive_exchange + REWRITE_SUFFIX
    declaration = _archive_queue(topology)
    counts = {"erased": 0, "records": 0, "duplicates": 0, "resumed": 0}
    if peek_queue(connection, temporary) is not None:  # an earlier rewrite died: finish its copy back first
        _declare(connection, declaration)
        back = transfer(connection, temporary, archive, archive, _as_is)
        counts["resumed"], counts["duplicates"] = back["read"] - back["duplicates"], back["duplicates"]
        _delete(connection, temporary)
    erase = _erasable(connection, topology, set(erase_keys or ()))
    if not erase and not always:
        return counts
    arguments = dict(getattr(declaration, "queue_arguments", None) or {})
    _declare(connection, Queue(temporary, durable=True, queue_arguments=arguments))
    out = transfer(connection, archive, temporary, archive, _without(erase))
    _delete(connection, archive)
    _declare(connection, declaration)
    back = transfer(connection, temporary, archive, archive, _as_is)
    _delete(connection, temporary)
    counts["erased"] = out["erased"]
    counts["records"] = back["read"] - back["duplicates"]
    counts["duplicates"] += out["duplicates"] + back["duplicates"]
    logger.info("kombu-events: rewrote the archive %s: %d cop%s removed for good, %d records kept", archive,
                counts["erased"], "y" if counts["erased"] == 1 else "ies", counts["records"])
    return counts


def _erasable(connection: Any, topology: Topology, erase_keys: set[str]) -> set[str]:
    """Keys of the copies in the archive to remove: named by a purged settlement, or asked for."""
    present: set[str] = set()
    purged: set[str] = set()
    for record in records(connection, topology, body_limit=0):
        if isinstance(record, ArchivedMessage):
            present.add(record.key)
        elif record.action == records_.PURGED:
            purged.update(record.keys)
    return present & (purged | erase_keys)


def _as_is(offset: int, headers: dict[str, Any], message: Any) -> tuple[bytes, dict[str, Any]]:
    return streams.body_of(message), _properties(message, headers)


def _properties(message: Any, headers: dict[str, Any]) -> dict[str, Any]:
    properties = {k: wire.as_sent(v) for k, v in message.properties.items() if k != "application_headers"}
    properties["application_headers"] = {k: wire.as_sent(v) for k, v in headers.items()}
    return properties


def _without(erase: set[str]) -> Keep:
    """What the copy out keeps: every record but the erased copies; settlements without their keys."""
    def keep(offset: int, headers: dict[str, Any], message: Any) -> tuple[bytes, dict[str, Any]] | None:
        if records_.is_settlement(headers):
            return _settlement_without(streams.body_of(message), _properties(message, headers), erase)
        key = str(headers.get(wire.ARCHIVE_KEY) or f"@{offset}")  # the key readers know it by, for good
        if key in erase:
            return None
        headers = {**headers, wire.ARCHIVE_KEY: key}
        return streams.body_of(message), _properties(message, headers)
    return keep


def _settlement_without(body: bytes, properties: dict[str, Any], erase: set[str]) -> tuple[bytes, dict[str, Any]]:
    try:
        data = json.loads(body)
        keys = [str(k) for k in data.get("keys", ())]
    except (ValueError, TypeError, AttributeError):
        return body, properties  # unreadable: it settles nothing, kept as it is
    if not erase.intersection(keys):
        return body, properties
    gone = len([k for k in keys if k in erase])
    data["keys"] = [k for k in keys if k not in erase]
    data["detail"] = {k: v for k, v in dict(data.get("detail") or {}).items() if k not in erase}
    data["note"] = f"{data.get('note', '')} ({gone} erased for good)".strip()
    return json.dumps(data, separators=(",", ":")).encode(), properties


def _archive_queue(topology: Topology) -> Queue:
    return next(q for q in topology.queues if q.name == topology.archive_exchange)


def _declare(connection: Any, queue: Queue) -> None:
    channel = connection.channel()
    try:
        queue.bind(channel).queue_declare()
    finally:
        close_quietly(channel)


def _delete(connection: Any, name: str) -> None:
    channel = connection.channel()
    try:
        channel.queue_delete(name)
    except NotFound:
        pass
    finally:
        close_quietly(channel)
