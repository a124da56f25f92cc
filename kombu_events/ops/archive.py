"""Archive operations on the broker: list, show, replay, purge -- without ever losing a message.

Messages are read with ``basic_get`` (replay and browse: a consumer) and no ack; what is
not acked goes back to the archive when the channel closes (in its place, a crash of the
process included). Replay republishes (mandatory) through the delivery exchange, addressed
to the original queue, and acks the archived original in the same AMQP transaction: copy
and ack take effect together, at the commit, or neither does (a connection lost first).
A copy whose queue is deleted before the commit is not delivered: RabbitMQ 3.x returns it
at the commit; RabbitMQ 4 refuses the commit (``partial tx completion``) after the acks and
the other copies took effect. On both, replay publishes the original of every copy not
delivered to the archive again and keeps it, and on RabbitMQ 4 reads on from a fresh
channel (:func:`replay`). A selective purge acks the messages that match and nothing else:
the others go back when the channel closes, as after a listing.

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
from collections import Counter, deque
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping

from amqp import Message
from amqp.exceptions import ChannelError

from ..broker.declare import close_quietly, peek_queue, queue_counts
from ..core import headers as wire
from ..core.logs import escape_controls
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
    holds exactly the messages whose copies were not sent. (A commit that RabbitMQ 4 refuses
    after it took effect in part is settled within the same call, on the same connection.)
    """

    #: Copies committed (their originals removed from the archive in the same commit), over every connection.
    copies_confirmed: int = 0
    #: Transactions committed (in part too, see :func:`replay`), over every connection.
    commits: int = 0


#: Why the original of a copy not delivered at its commit is kept (the same words on every broker version).
_ARCHIVED_AGAIN = "returned by the broker (its queue was deleted during the replay); archived again"


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
    A lost connection raises (py-amqp's or the socket's error).

    A copy addressed to a queue that does not exist is never sent (its original stays in its
    place). A queue deleted after that check and before the commit:

    - RabbitMQ 3.x returns its copies at the commit (``basic.return``), which succeeds: the
      originals' acks take effect.
    - RabbitMQ 4 refuses the commit (``PRECONDITION_FAILED - partial tx completion``) and closes
      the channel, the connection alive, after the acks of the transaction took effect and so
      did its copies to queues that exist. Each copy of it that was returned or whose queue is
      gone (a passive declare) counts as not delivered, every other one as replayed; the replay
      reads on from a fresh channel (the closed one's unacked messages went back to their
      places; those already looked at are passed over, never looked at or kept twice). Logged
      at WARNING, with counts.

    Either way the original of a copy not delivered is published to the archive again as it was
    archived (at the archive's end), in a commit of its own, and kept: nothing replayed is lost.
    """
    request = _Request(match, limit, to_queue, dict(stamp or {}), edits, getattr(connection, "userid", None),
                       window, commit_every_s, idle_s)
    run = _Replay(connection, topology, request, progress)
    try:
        run.run()
    except BaseException:
        run.close(quietly=True)  # an open transaction is rolled back: every message not acked goes back
        raise
    run.close()
    return run.replayed, run.kept


def _unsendable(connection: Any, queue: str, handler_queues: set[str]) -> str | None:
    """Why a copy cannot be sent to ``queue`` (not this service's, or not on the broker), else None."""
    if queue not in handler_queues:
        return f"queue {queue!r} is not a queue of this service"
    if peek_queue(connection, queue) is None:
        return f"queue {queue!r} does not exist on the broker (declare it, or replay to another queue)"
    return None


@dataclass(frozen=True)
class _Request:
    """What :func:`replay` was asked to do (its arguments but the connection, the topology and the progress)."""

    match: Callable[[ArchivedMessage], bool]
    limit: int | None
    to_queue: str | None
    stamp: Mapping[str, Any]
    edits: Mapping[str, bytes] | None
    userid: str | None
    window: int
    commit_every_s: float
    idle_s: float

    def copy_of(self, message: ArchivedMessage) -> tuple[bytes, dict[str, Any]]:
        """Body and properties of ``message``'s copy; an edited one under a new id, the original's in a header."""
        headers = {**wire.replay_headers(message.headers), **self.stamp}
        edited = self.edits.get(message.id) if self.edits is not None else None
        if edited is not None:
            headers[ORIGINAL_ID] = message.id
        properties = wire.republish_properties(message.properties, headers, userid=self.userid)
        if edited is None:
            return message.body, properties
        properties["message_id"] = uuid.uuid4().hex
        return edited, properties


@dataclass
class _Copy:
    """A copy sent in the open transaction: its original, the queue it is for, and how a return of it reads."""

    original: ArchivedMessage
    queue: str
    #: (message id, routing key, body), as :meth:`_Transaction.returned` notes a returned message.
    returned_as: tuple[Any, Any, bytes]


def _undelivered(copies: list[_Copy], returns: list[tuple[Any, Any, bytes]],
                 gone: set[str]) -> tuple[list[_Copy], list[_Copy]]:
    """(delivered, not delivered) of one transaction's copies: not delivered, each copy the broker returned
    (one return settles one copy) and each copy for a queue ``gone`` (looked up after a refused commit)."""
    unmatched = list(returns)
    delivered: list[_Copy] = []
    back: list[_Copy] = []
    for copy in copies:
        if copy.returned_as in unmatched:
            unmatched.remove(copy.returned_as)
            back.append(copy)
        elif copy.queue in gone:
            back.append(copy)
        else:
            delivered.append(copy)
    return delivered, back


class _Settled:
    """Messages this replay settled that the archive delivers to it again, counted by id: those it left
    (back in their places when their channel closes) and those it archived again (at the archive's end).

    A delivery of one is passed over: no message is looked at, kept or archived again twice. (An id
    repeats in the archive only for one message archived twice: each of its deliveries counts.)
    """

    def __init__(self) -> None:
        self.again: Counter[str] = Counter()  # settled ones the current channel may deliver
        self.held: Counter[str] = Counter()  # left unacked on the current channel: the next one delivers them

    def passed_over(self, key: str) -> bool:
        """Whether this delivery of ``key`` is a message settled before (then left again)."""
        if self.again[key] <= 0:
            return False
        self.again[key] -= 1
        self.held[key] += 1
        return True

    def left(self, key: str) -> None:
        self.held[key] += 1

    def archived_again(self, key: str) -> None:
        self.again[key] += 1

    def channel_closed(self) -> None:
        """Every message left unacked on the channel just closed is back in the archive."""
        self.again.update(self.held)
        self.held.clear()

    def expected(self) -> int:
        """How many deliveries may still be of settled messages."""
        return sum(self.again.values())


class _Transaction:
    """The copies sent in the replay's open transaction, and the returns noted since the last commit."""

    def __init__(self) -> None:
        self.copies: list[_Copy] = []
        #: (message id, routing key, body) of each message the broker returned.
        self.returns: list[tuple[Any, Any, bytes]] = []
        self.began = 0.0

    def sent(self, copy: _Copy) -> None:
        if not self.copies:
            self.began = time.monotonic()
        self.copies.append(copy)

    def due(self, window: int, every_s: float) -> bool:
        return bool(self.copies) and (len(self.copies) >= window or time.monotonic() - self.began >= every_s)

    def returned(self, exc: Any, exchange: Any, routing_key: Any, message: Any) -> None:
        """py-amqp callback, inside a commit's wait (a return comes before the commit's answer): note only."""
        self.returns.append((message.properties.get("message_id"), routing_key, bytes(message.body or b"")))

    def ended(self) -> tuple[list[_Copy], list[tuple[Any, Any, bytes]]]:
        """The copies and the returns of the transaction just ended; the next one starts empty."""
        copies, self.copies = self.copies, []
        return copies, self.take_returns()

    def take_returns(self) -> list[tuple[Any, Any, bytes]]:
        returns, self.returns = self.returns, []
        return returns


class _Replay:
    """One call of :func:`replay`: the channel it reads and copies on, and what it did so far."""

    def __init__(self, connection: Any, topology: Topology, request: _Request,
                 progress: ReplayProgress | None) -> None:
        self.connection, self.topology, self.request, self.progress = connection, topology, request, progress
        self.replayed: list[ArchivedMessage] = []
        self.kept: list[tuple[ArchivedMessage, str]] = []
        self.handler_queues = {q.name for q in topology.handler_queues}
        self.unsendable: dict[str, str | None] = {}  # target queue -> why nothing can be sent to it (None: it exists)
        self.tx, self.settled = _Transaction(), _Settled()
        self.arrived: deque[Any] = deque()
        self.total = self.seen = self.chosen = 0
        self.channel: Any = None
        self.acks = _Acks(None)

    def run(self) -> None:
        """Look at every message in the archive at the start, in order (or until ``limit`` are chosen,
        or none arrives for ``idle_s``: messages expired meanwhile); copy those that match."""
        self._open()
        self.total = queue_counts(self.channel, self.topology.archive_exchange).messages
        if not self._wanted():
            return
        self._consume()
        while self._wanted() and self._step():
            pass
        self._commit()

    def close(self, *, quietly: bool = False) -> None:
        """Close the channel; ``quietly``: after an error (a failure to close is logged at debug)."""
        if self.channel is not None and quietly:
            close_quietly(self.channel)
        elif self.channel is not None:
            self.channel.close()

    def _wanted(self) -> bool:
        limit = self.request.limit
        return self.seen < self.total and (limit is None or self.chosen < limit)

    def _open(self) -> None:
        """A fresh channel in a transaction (returns noted), its deliveries counted from 1."""
        self.channel = _channel(self.connection)
        self.channel.tx_select()
        self.channel.events["basic_return"].add(self.tx.returned)
        self.acks = _Acks(self.channel)
        self.arrived.clear()  # deliveries of a closed channel: back in the archive

    def _consume(self) -> None:
        """Consume the archive from its head; the prefetch holds every message still to look at and every
        settled one delivered again (each may stay unacked until the channel closes)."""
        prefetch = self.total - self.seen + self.settled.expected()
        self.channel.basic_qos(0, prefetch if prefetch <= 65_535 else 0, False)  # 0: no limit (a short at most)
        self.channel.basic_consume(self.topology.archive_exchange, no_ack=False, callback=self.arrived.append)

    def _step(self) -> bool:
        """Commit when due; look at the next message, or wait for one (False: none came in ``idle_s``)."""
        if not self.arrived or self.tx.due(self.request.window, self.request.commit_every_s):
            self._commit()  # also before any wait: what was sent takes effect first
        if self.arrived:
            self._look_at(_parse(self.arrived.popleft()))
            return True
        try:
            self.connection.drain_events(timeout=self.request.idle_s)
        except socket.timeout:
            return False  # messages expired meanwhile
        return True

    def _look_at(self, message: ArchivedMessage) -> None:
        """Pass over a message settled before; else leave it, keep it (its queue cannot take it) or copy it."""
        self.acks.delivered(message.delivery_tag)
        if self.settled.passed_over(message.id):
            self.acks.leave()
            return
        self.seen += 1
        if not self.request.match(message):
            self._leave(message)
            return
        self.chosen += 1
        queue = self.request.to_queue or message.queue
        if queue not in self.unsendable:
            self.unsendable[queue] = _unsendable(self.connection, queue, self.handler_queues)
        why = self.unsendable[queue]
        if why is not None:
            self.kept.append((message, why))
            self._leave(message)
            return
        self._send(message, queue)

    def _leave(self, message: ArchivedMessage) -> None:
        """``message`` stays in the archive: unacked, it goes back to its place when the channel closes."""
        self.acks.leave()
        self.settled.left(message.id)

    def _send(self, message: ArchivedMessage, queue: str) -> None:
        """Publish the copy (mandatory) and ack the original, both in the open transaction."""
        body, properties = self.request.copy_of(message)
        address = self.topology.address(queue, 0)
        self.channel.basic_publish(Message(body, **properties), exchange=address.exchange,
                                   routing_key=address.routing_key, mandatory=True)
        self.acks.ack(message.delivery_tag)
        self.tx.sent(_Copy(message, queue, (properties.get("message_id"), address.routing_key, body)))

    def _commit(self) -> None:
        """Commit the copies with the acks of their originals, and settle them."""
        if not self.tx.copies:
            return
        self.acks.flush(every=True)
        try:
            self.channel.tx_commit()
        except ChannelError as exc:  # not the connection's: py-amqp reopened the channel, the connection alive
            self._refused(exc)
            return
        self._settle(gone=set())

    def _refused(self, exc: ChannelError) -> None:
        """The broker refused the commit and closed the channel (RabbitMQ 4: ``partial tx completion``, a copy's
        queue deleted meanwhile) after the acks and the copies to queues that exist took effect. The copies
        for queues gone are not delivered; the replay reads on from a fresh channel."""
        sent = len(self.tx.copies)
        gone = {queue for queue in {copy.queue for copy in self.tx.copies}
                if peek_queue(self.connection, queue) is None}
        close_quietly(self.channel)  # as py-amqp reopened it: no transaction, no consumer
        self.settled.channel_closed()
        self._open()
        back = self._settle(gone)
        logger.warning("kombu-events: the broker refused a replay's commit after it took effect in part (%s): "
                       "%d copies sent, %d delivered, %d not (their queue is gone; originals archived again); "
                       "reading on from a fresh channel", escape_controls(exc), sent, sent - len(back), len(back))
        if self._wanted():
            self._consume()

    def _settle(self, gone: set[str]) -> list[_Copy]:
        """Count the transaction's delivered copies; archive again the originals of the others (returned)."""
        copies, returns = self.tx.ended()
        delivered, back = _undelivered(copies, returns, gone)
        self.replayed.extend(copy.original for copy in delivered)
        if self.progress is not None:
            self.progress.copies_confirmed += len(delivered)
            self.progress.commits += 1
        for copy in back:
            self.unsendable.pop(copy.queue, None)  # look at the queue again before the next copy for it
        if back:
            self._archive_again([copy.original for copy in back])
        return back

    def _archive_again(self, back: list[ArchivedMessage]) -> None:
        """The originals of copies not delivered, as they were archived, to the archive in a commit of their own."""
        for message in back:
            self.channel.basic_publish(Message(message.body, **message.properties),
                                       exchange=self.topology.archive_exchange,
                                       routing_key=wire.as_sent(message.routing_key), mandatory=True)
        self.channel.tx_commit()
        lost = self.tx.take_returns()
        self.kept.extend((message, _ARCHIVED_AGAIN) for message in back)
        for message in back:
            self.settled.archived_again(message.id)  # at the archive's end: not to be read again as new
        if lost:  # the archive queue itself is gone: nothing more can keep them
            logger.error("kombu-events: %d replayed messages were not delivered and could not be archived "
                         "again (is the archive queue %s gone?): %s", len(lost),
                         self.topology.archive_exchange, ", ".join(escape_controls(m) for m, _, _ in lost))


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
