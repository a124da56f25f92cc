"""Archive operations on the broker: list, show, replay, purge -- without ever losing a message.

Messages are read with ``basic_get`` (replay and browse: a consumer) and no ack; what is
not acked goes back to the archive when the channel closes (in its place, a crash of the
process included). Replay republishes (mandatory) through the delivery exchange, addressed
to the original queue, and acks the archived original in the same AMQP transaction: copy
and ack take effect together, at the commit, or neither does. A selective purge acks the
messages that match and nothing else: the others go back when the channel closes, as
after a listing.

Every operation selects alike: the archive's messages in order, those that ``match``,
at most ``limit`` of them (:func:`read` finds what :func:`replay` or :func:`purge`
would take). :func:`browse` reads like :func:`read` with a consumer instead of a ``basic_get``
per message, for the console's thousands.
"""
from __future__ import annotations

__all__ = ["ArchivedMessage", "ReplayProgress", "read", "browse", "replay", "purge", "purge_all", "message_key"]

import hashlib
import logging
import socket
import time
import uuid
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping

from amqp import Message

from ..broker.declare import peek_queue, queue_counts
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
    """What one replay did, counted across connections (the console's job shows it).

    Nothing else needs remembering across a lost connection: copies and the acks of their
    originals take effect together, at a commit (:func:`replay`), so the archive read again
    holds exactly the messages whose copies were not sent.
    """

    #: Copies committed (their originals removed from the archive in the same commit), over every connection.
    copies_confirmed: int = 0
    #: Transactions committed, over every connection.
    commits: int = 0


def replay(connection: Any, topology: Topology, match: Callable[[ArchivedMessage], bool],
           limit: int | None = None, *, to_queue: str | None = None, stamp: Mapping[str, Any] | None = None,
           edits: Mapping[str, bytes] | None = None, progress: ReplayProgress | None = None,
           window: int = 200, commit_every_s: float = 0.25, idle_s: float = 5.0,
           ) -> tuple[list[ArchivedMessage], list[tuple[ArchivedMessage, str]]]:
    """Replay matching messages to their queues; return (replayed, [(kept, why)]).

    ``to_queue``: send every copy to this handler queue instead of the one it failed in;
    ``stamp``: headers added to every replayed copy (the console's audit trail); ``edits``:
    message id -> the body its copy carries instead, under a new message id, the original's
    in the ``kombu-events-original-id`` header (the console's edit-and-replay).

    The archive is read as :func:`browse` reads it (a consumer, no round trip per message).
    Each copy is published (mandatory), and its original acked, on that one channel in an
    AMQP transaction (``tx.select``); a ``tx.commit`` every ``window`` copies (or every
    ``commit_every_s``, and whenever nothing more is waiting) makes the copies and the acks
    take effect together, once the broker holds the copies (persistent ones on disk). A
    connection lost before the commit's answer leaves both or neither: an original is back
    in the archive exactly when its copy was not sent, so a replay run again (the console's
    job connects again and calls this again) sends each message once: none lost, none twice.

    A copy addressed to a queue that does not exist is never sent (its original stays); one
    the broker returns all the same (its queue was deleted meanwhile) has its original
    published to the archive again, in a commit of its own at once, and is kept.
    """
    channel = _channel(connection)
    replayed: list[ArchivedMessage] = []
    kept: list[tuple[ArchivedMessage, str]] = []
    handler_queues = {q.name for q in topology.handler_queues}
    userid = getattr(connection, "userid", None)
    arrived: deque[Any] = deque()
    acks = _Acks(channel)
    open_tx = _Transaction(channel, acks, topology, replayed, kept, progress)
    unsendable: dict[str, str | None] = {}  # target queue -> why nothing can be sent to it (None: it exists)
    chosen, finished = 0, False
    try:
        total = queue_counts(channel, topology.archive_exchange).messages
        if total <= 0 or (limit is not None and limit <= 0):
            return replayed, kept
        channel.tx_select()
        channel.events["basic_return"].add(open_tx.returned)
        channel.basic_qos(0, total if total <= 65_535 else 0, False)
        channel.basic_consume(topology.archive_exchange, no_ack=False, callback=arrived.append)
        seen = 0
        while seen < total and (limit is None or chosen < limit):
            if not arrived or open_tx.due(window, commit_every_s):
                open_tx.commit()  # also before any wait: what was sent takes effect first
            if not arrived:
                try:
                    connection.drain_events(timeout=idle_s)
                except socket.timeout:
                    break  # messages expired meanwhile
                continue
            seen += 1
            message = _parse(arrived.popleft())
            acks.delivered(message.delivery_tag)
            if not match(message):
                acks.leave()
                continue
            chosen += 1
            target = to_queue or message.queue
            if target not in unsendable:
                unsendable[target] = _unsendable(connection, target, handler_queues)
            why = unsendable[target]
            if why is not None:
                acks.leave()
                kept.append((message, why))
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
            channel.basic_publish(Message(body, **properties), exchange=address.exchange,
                                  routing_key=address.routing_key, mandatory=True)
            acks.ack(message.delivery_tag)
            open_tx.sent(message, properties.get("message_id"), address.routing_key, body)
        open_tx.commit()
        finished = True
        return replayed, kept
    finally:
        try:
            channel.close()  # an open transaction is rolled back: every message not acked goes back
        except Exception as exc:
            if finished:
                raise
            logger.debug("closing the replay's channel after an error failed too: %s", exc)


def _unsendable(connection: Any, queue: str, handler_queues: set[str]) -> str | None:
    """Why a copy cannot be sent to ``queue`` (not this service's, or not on the broker), else None."""
    if queue not in handler_queues:
        return f"queue {queue!r} is not a queue of this service"
    if peek_queue(connection, queue) is None:
        return f"queue {queue!r} does not exist on the broker (declare it, or replay to another queue)"
    return None


class _Transaction:
    """The copies sent in the replay channel's open transaction, and what its commit settles."""

    def __init__(self, channel: Any, acks: _Acks, topology: Topology, replayed: list[ArchivedMessage],
                 kept: list[tuple[ArchivedMessage, str]], progress: ReplayProgress | None) -> None:
        self.channel, self.acks, self.topology = channel, acks, topology
        self.replayed, self.kept, self.progress = replayed, kept, progress
        #: (original, (copy's message id, routing key, body)) of each copy sent since the last commit.
        self.copies: list[tuple[ArchivedMessage, tuple[Any, Any, bytes]]] = []
        #: (message id, routing key, body) of each copy the broker returned.
        self.returns: list[tuple[Any, Any, bytes]] = []
        self.began = 0.0

    def sent(self, message: ArchivedMessage, message_id: Any, routing_key: Any, body: bytes) -> None:
        if not self.copies:
            self.began = time.monotonic()
        self.copies.append((message, (message_id, routing_key, body)))

    def due(self, window: int, every_s: float) -> bool:
        return bool(self.copies) and (len(self.copies) >= window or time.monotonic() - self.began >= every_s)

    def returned(self, exc: Any, exchange: Any, routing_key: Any, message: Any) -> None:
        """py-amqp callback, inside the commit's wait (a return comes before the commit's answer): note only."""
        self.returns.append((message.properties.get("message_id"), routing_key, bytes(message.body or b"")))

    def commit(self) -> None:
        """Commit the copies with the acks of their originals; archive again the originals of copies returned."""
        if not self.copies:
            return
        self.acks.flush(every=True)
        self.channel.tx_commit()
        copies, self.copies = self.copies, []
        returns, self.returns = self.returns, []
        back = []
        for message, copy in copies:
            if copy in returns:
                returns.remove(copy)
                back.append(message)
            else:
                self.replayed.append(message)
        if self.progress is not None:
            self.progress.copies_confirmed += len(copies) - len(back)
            self.progress.commits += 1
        if back:
            self._archive_again(back)

    def _archive_again(self, back: list[ArchivedMessage]) -> None:
        """Originals whose copies the broker returned (their queue was deleted mid-replay), as they were archived."""
        for message in back:
            self.channel.basic_publish(Message(message.body, **message.properties),
                                       exchange=self.topology.archive_exchange,
                                       routing_key=wire.as_sent(message.routing_key), mandatory=True)
        self.channel.tx_commit()
        lost, self.returns = self.returns, []
        why = "returned by the broker (its queue was deleted during the replay); archived again"
        self.kept.extend((message, why) for message in back)
        if lost:  # the archive queue itself is gone: nothing more can keep them
            logger.error("kombu-events: %d replayed messages were returned by the broker and could not be "
                         "archived again (is the archive queue %s gone?): %s", len(lost),
                         self.topology.archive_exchange, ", ".join(str(m) for m, _, _ in lost))


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
