"""Archive operations on the broker: list, show, replay, purge -- without ever losing a message.

Messages are read with ``basic_get`` (replay and browse: a consumer) and no ack; what is
not acked goes back to the archive when the channel closes (in its place, a crash of the
process included). Replay republishes (mandatory, confirmed) through the delivery exchange, addressed to the
original queue, and acks the archived copy only once the broker confirmed the replayed
one. A selective purge acks the messages that match and nothing else: the others go
back when the channel closes, as after a listing.

Every operation selects alike: the archive's messages in order, those that ``match``,
at most ``limit`` of them (:func:`read` finds what :func:`replay` or :func:`purge`
would take). :func:`browse` reads like :func:`read` with a consumer instead of a ``basic_get``
per message, for the console's thousands.
"""
from __future__ import annotations

__all__ = ["ArchivedMessage", "ReplayProgress", "read", "browse", "replay", "purge", "purge_all", "message_key"]

import hashlib
import logging
import select
import socket
import uuid
from collections import deque
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable, Iterator, Mapping

from amqp import Message

from ..broker.confirms import Confirmer
from ..broker.declare import queue_counts
from ..core import headers as wire
from ..core.topology import Topology

logger = logging.getLogger(__name__)

#: On an edited copy (``replay(edits=...)``): the message id of the archived original.
ORIGINAL_ID = wire.PREFIX + "original-id"


@dataclass
class ArchivedMessage:
    """One archived message as read from the archive queue."""

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
    delivery_tag: int

    def summary(self) -> dict[str, Any]:
        """JSON-friendly fields (body as text when it decodes)."""
        try:
            body: Any = self.body.decode("utf-8")
        except UnicodeDecodeError:
            body = repr(self.body)
        return {"id": self.id, "queue": self.queue, "routing_key": self.routing_key, "reason": self.reason,
                "attempts": _jsonable(self.attempts), "archived_at": self.archived_at, "exception": self.exception,
                "traceback": self.traceback, "headers": _jsonable(self.headers),
                "properties": _jsonable({k: v for k, v in self.properties.items() if k != "application_headers"}),
                "body": body}


def message_key(properties: dict[str, Any], body: bytes, headers: dict[str, Any]) -> str:
    """The message id, or a stable digest when the publisher set none."""
    if properties.get("message_id"):
        return str(properties["message_id"])
    digest = hashlib.sha1(body + str(headers.get(wire.ARCHIVED_AT, "")).encode()).hexdigest()
    return f"sha1:{digest[:16]}"


def _parse(msg: Any) -> ArchivedMessage:
    body = msg.body  # bytes: archive channels are opened with auto_decode off
    h = dict(msg.properties.get("application_headers") or {})
    return ArchivedMessage(
        id=message_key(msg.properties, body, h), queue=str(h.get(wire.QUEUE, "")),
        routing_key=str(h.get(wire.ROUTING_KEY, msg.delivery_info.get("routing_key", ""))),
        reason=str(h.get(wire.REASON, "")), attempts=h.get(wire.ATTEMPTS), archived_at=str(h.get(wire.ARCHIVED_AT, "")),
        exception=str(h.get(wire.EXCEPTION, "")), traceback=str(h.get(wire.TRACEBACK, "")),
        headers=h, properties=dict(msg.properties), body=body, delivery_tag=msg.delivery_tag)


def _scan(channel: Any, queue: str) -> Iterator[ArchivedMessage]:
    """Every message now in ``queue``, left unacked (they return when the channel closes).

    A missing ``queue`` raises amqp's NotFound.
    """
    for _ in range(queue_counts(channel, queue).messages):
        msg = channel.basic_get(queue, no_ack=False)
        if msg is None:
            return
        yield _parse(msg)


def _channel(connection: Any) -> Any:
    channel = connection.channel()
    channel.auto_decode = False  # keep body bytes exactly as archived
    return channel


def read(connection: Any, topology: Topology, match: Callable[[ArchivedMessage], bool] = lambda m: True,
         limit: int | None = None) -> list[ArchivedMessage]:
    """Archived messages that ``match`` (at most ``limit``); the archive is left unchanged."""
    channel = _channel(connection)
    try:
        found = []
        for message in _scan(channel, topology.archive_exchange):
            if match(message):
                found.append(message)
                if limit is not None and len(found) >= limit:
                    break
        return found
    finally:
        channel.close()  # unacked: every message goes back to the archive


def browse(connection: Any, topology: Topology, limit: int = 100_000, idle_s: float = 5.0) -> list[ArchivedMessage]:
    """The first ``limit`` messages now in the archive, in order; the archive is left unchanged.

    :func:`read` without its round trip per message, for the console's thousands: a consumer
    that never acks, with a prefetch of exactly the messages wanted (no more are sent; above
    65,535, the largest prefetch, no limit and the extra ones are not kept), then
    the channel closes and every one goes back in its place, as after :func:`read`. Stops
    early when nothing arrives for ``idle_s`` (messages expired meanwhile).
    """
    channel = _channel(connection)
    found: list[ArchivedMessage] = []
    try:
        wanted = min(queue_counts(channel, topology.archive_exchange).messages, limit)
        if wanted <= 0:
            return found
        channel.basic_qos(0, wanted if wanted <= 65_535 else 0, False)  # 0: no limit (a short at most)
        channel.basic_consume(topology.archive_exchange, no_ack=False,
                              callback=lambda msg: found.append(_parse(msg)))
        while len(found) < wanted:
            try:
                connection.drain_events(timeout=idle_s)
            except socket.timeout:
                break
        return found[:wanted]
    finally:
        channel.close()  # unacked: every message goes back to the archive


@dataclass
class ReplayProgress:
    """What one replay learned, kept across connections: so that a broker restart duplicates nothing it confirmed.

    An archived message is identified by its message id (:func:`message_key`) *and* the
    ``kombu-events-archived-at`` header the worker stamped when it archived it: an original
    whose copy the broker confirmed, but whose ack was lost with the connection, comes back
    to the archive with both unchanged, and is then acked without being sent again; a
    message with the same id archived at another time is another failure (a copy that
    failed again, a publisher that reuses ids), never taken for it.
    """

    #: message id -> archived-at of each original whose copy the broker confirmed.
    confirmed: dict[str, set[str]] = field(default_factory=dict)
    #: message id -> archived-at of copies published but not confirmed when a connection was lost.
    in_doubt: dict[str, str] = field(default_factory=dict)
    #: Copies the broker confirmed (their originals acked), over every connection.
    copies_confirmed: int = 0
    #: Originals back in the archive after their copy was confirmed: acked, not sent again.
    acked_again: int = 0
    #: Ids of copies sent again after their first publish was lost unconfirmed (each may be a duplicate:
    #: the broker may have taken the first before the connection died; AMQP cannot tell).
    resent: set[str] = field(default_factory=set)


def replay(connection: Any, topology: Topology, match: Callable[[ArchivedMessage], bool],
           limit: int | None = None, *, to_queue: str | None = None, stamp: Mapping[str, Any] | None = None,
           edits: Mapping[str, bytes] | None = None, progress: ReplayProgress | None = None,
           window: int = 200, idle_s: float = 5.0,
           ) -> tuple[list[ArchivedMessage], list[tuple[ArchivedMessage, str]]]:
    """Replay matching messages to their queues; return (replayed, [(kept, why)]).

    ``to_queue``: send every copy to this handler queue instead of the one it failed in;
    ``stamp``: headers added to every replayed copy (the console's audit trail); ``edits``:
    message id -> the body its copy carries instead, under a new message id, the original's
    in the ``kombu-events-original-id`` header (the console's edit-and-replay).

    The archive is read as :func:`browse` reads it (a consumer, no round trip per message)
    and copies are published pipelined, at most ``window`` unconfirmed at a time; each
    original is acked in its copy's confirm. ``progress``: call again with the same object
    after a lost connection, and what the broker already confirmed is not sent again
    (:class:`ReplayProgress`); the connection's error propagates, the progress kept.
    """
    channel = _channel(connection)
    confirmer = Confirmer(channel)
    replayed: list[ArchivedMessage] = []
    kept: list[tuple[ArchivedMessage, str]] = []
    handler_queues = {q.name for q in topology.handler_queues}
    userid = getattr(connection, "userid", None)
    unconfirmed: dict[int, tuple[str, str]] = {}  # delivery tag -> (id, archived-at) of a copy not yet confirmed
    arrived: deque[Any] = deque()
    acks = _Acks(channel)
    chosen, finished = 0, False
    try:
        total = queue_counts(channel, topology.archive_exchange).messages
        if total <= 0 or (limit is not None and limit <= 0):
            return replayed, kept
        channel.basic_qos(0, total if total <= 65_535 else 0, False)
        channel.basic_consume(topology.archive_exchange, no_ack=False, callback=arrived.append)
        seen = 0
        while seen < total and (limit is None or chosen < limit):
            if not arrived:
                try:
                    connection.drain_events(timeout=idle_s)
                except socket.timeout:
                    break  # messages expired meanwhile
                acks.flush()
                continue
            seen += 1
            message = _parse(arrived.popleft())
            acks.delivered(message.delivery_tag)
            if progress is not None and message.id in progress.confirmed:
                if message.archived_at in progress.confirmed[message.id]:
                    acks.ack(message.delivery_tag)  # its copy was confirmed: the ack was lost with a connection
                    progress.acked_again += 1
                else:  # another failure with that id, archived since: not this replay's
                    acks.leave()
                continue
            if not match(message):
                acks.leave()
                continue
            chosen += 1
            target = to_queue or message.queue
            if target not in handler_queues:
                acks.leave()
                kept.append((message, f"queue {target!r} is not a queue of this service"))
                continue
            headers = {**wire.replay_headers(message.headers), **(stamp or {})}
            edited = edits is not None and message.id in edits
            if edited:
                headers[ORIGINAL_ID] = message.id
            properties = wire.republish_properties(message.properties, headers, userid=userid)
            if edited:
                properties["message_id"] = uuid.uuid4().hex
            body = edits[message.id] if edits is not None and edited else message.body
            address = topology.address(target, 0)
            if progress is not None and progress.in_doubt.pop(message.id, None) is not None:
                progress.resent.add(message.id)
            unconfirmed[message.delivery_tag] = (message.id, message.archived_at)
            confirmer.publish(Message(body, **properties), address.exchange, address.routing_key,
                              on_ok=_acker(acks, message, replayed, progress, unconfirmed),
                              on_fail=partial(_keeper, kept, acks, message, unconfirmed))
            _read_waiting(connection)  # confirms as they come: fewer copies in doubt if the connection drops
            while confirmer.pending >= window:
                connection.drain_events(timeout=30)
                acks.flush()
            acks.flush()
        while confirmer.pending:
            connection.drain_events(timeout=30)
            acks.flush()
        finished = True
        return replayed, kept
    except BaseException:
        if progress is not None:
            progress.in_doubt.update(unconfirmed.values())
        raise
    finally:
        try:
            acks.flush(every=True)  # sent before the close, so taken before the rest goes back
            channel.close()  # unacked: every message not replayed goes back to the archive
        except Exception as exc:
            if finished:
                raise
            logger.debug("closing the replay's channel after an error failed too: %s", exc)


def _read_waiting(connection: Any) -> None:
    """Read what the broker has already sent (confirms, deliveries), without waiting for more."""
    sock = getattr(getattr(connection, "connection", None), "sock", None)
    try:
        while sock is not None and select.select([sock], [], [], 0)[0]:
            connection.drain_events(timeout=0.05)
    except socket.timeout:
        pass


class _Acks:
    """The acks of archived originals, sent after each read of the connection: one ``basic.ack``
    with ``multiple`` for a run of consecutive delivery tags, as long as every message delivered
    before is to be acked too; from the first message left in the archive on, one ack each.

    Callbacks only note a tag (no I/O inside py-amqp's frame dispatch); :meth:`flush` sends.
    """

    def __init__(self, channel: Any) -> None:
        self.channel = channel
        self.ready: set[int] = set()
        self.next = 1  # the lowest delivery tag not acked yet (a channel numbers its deliveries from 1)
        self.expected = 1
        self.single = False

    def delivered(self, tag: int) -> None:
        """A delivery is being looked at, in order: any surprise in the numbering ends ``multiple``."""
        if tag != self.expected:
            self.leave()
        self.expected = tag + 1

    def ack(self, tag: int) -> None:
        self.ready.add(tag)

    def leave(self) -> None:
        """A message stays in the archive: no ``multiple`` ack may cover it."""
        if not self.single:
            self.flush()
            self.single = True

    def flush(self, *, every: bool = False) -> None:
        """Send the acks noted; ``every``: also those not yet in a consecutive run (the end)."""
        if not self.ready:
            return
        if not self.single:
            first = self.next
            while self.next in self.ready:
                self.ready.discard(self.next)
                self.next += 1
            if self.next > first:
                self.channel.basic_ack(self.next - 1, multiple=True)
            if not every:
                return  # the others wait for the copies before them to be confirmed
        for tag in sorted(self.ready):
            self.channel.basic_ack(tag)
        self.ready.clear()


def _keeper(kept: list[tuple[ArchivedMessage, str]], acks: _Acks, message: ArchivedMessage,
            unconfirmed: dict[int, tuple[str, str]], why: str) -> None:
    unconfirmed.pop(message.delivery_tag, None)
    acks.single = True  # a callback sends nothing: the next flush acks the others one by one
    kept.append((message, why))


def _acker(acks: _Acks, message: ArchivedMessage, replayed: list[ArchivedMessage],
           progress: ReplayProgress | None, unconfirmed: dict[int, tuple[str, str]]) -> Callable[[], None]:
    def ack() -> None:
        unconfirmed.pop(message.delivery_tag, None)
        if progress is not None:  # remembered before the ack, which the connection may lose
            progress.confirmed.setdefault(message.id, set()).add(message.archived_at)
            progress.copies_confirmed += 1
        replayed.append(message)
        acks.ack(message.delivery_tag)
    return ack


def purge(connection: Any, topology: Topology, match: Callable[[ArchivedMessage], bool],
          limit: int | None = None) -> list[ArchivedMessage]:
    """Delete the archived messages that ``match`` (the first ``limit`` of them); return those deleted.

    Only a message that matches is acked (deleted); every other one, read unacked, goes
    back to the archive in its place when the channel closes -- also when this raises
    half-way or the process dies. The list returns once the channel closed cleanly, so
    the broker has taken every ack by then.
    """
    channel = _channel(connection)
    removed: list[ArchivedMessage] = []
    try:
        if limit is not None and limit <= 0:
            return removed
        for message in _scan(channel, topology.archive_exchange):
            if match(message):
                channel.basic_ack(message.delivery_tag)
                removed.append(message)
                if limit is not None and len(removed) >= limit:
                    break
        return removed
    finally:
        channel.close()  # unacked: every message that did not match goes back to the archive


def purge_all(connection: Any, topology: Topology) -> int:
    """Delete every archived message at once (``queue.purge``); return how many."""
    channel = _channel(connection)
    try:
        return channel.queue_purge(topology.archive_exchange) or 0
    finally:
        channel.close()


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
