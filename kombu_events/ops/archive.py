"""Archive operations on the broker: list, show, replay, purge -- without ever losing a message.

Messages are read with ``basic_get`` and no ack; what is not acked goes back to the
archive when the channel closes (in its place, a crash of the process included). Replay
republishes (mandatory, confirmed) through the delivery exchange, addressed to the
original queue, and acks the archived copy only once the broker confirmed the replayed
one. A selective purge acks the messages that match and nothing else: the others go
back when the channel closes, as after a listing.

Every operation selects alike: the archive's messages in order, those that ``match``,
at most ``limit`` of them (:func:`read` finds what :func:`replay` or :func:`purge`
would take).
"""
from __future__ import annotations

__all__ = ["ArchivedMessage", "read", "replay", "purge", "purge_all", "message_key"]

import hashlib
import logging
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Iterator

from amqp import Message

from ..broker.confirms import Confirmer
from ..broker.declare import queue_counts
from ..core import headers as wire
from ..core.topology import Topology

logger = logging.getLogger(__name__)


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


def replay(connection: Any, topology: Topology, match: Callable[[ArchivedMessage], bool],
           limit: int | None = None) -> tuple[list[ArchivedMessage], list[tuple[ArchivedMessage, str]]]:
    """Replay matching messages to their queues; return (replayed, [(kept, why)])."""
    channel = _channel(connection)
    confirmer = Confirmer(channel)
    replayed: list[ArchivedMessage] = []
    kept: list[tuple[ArchivedMessage, str]] = []
    handler_queues = {q.name for q in topology.handler_queues}
    userid = getattr(connection, "userid", None)
    chosen = 0
    try:
        for message in _scan(channel, topology.archive_exchange):
            if limit is not None and chosen >= limit:
                break
            if not match(message):
                continue
            chosen += 1
            if message.queue not in handler_queues:
                kept.append((message, f"queue {message.queue!r} is not a queue of this service"))
                continue
            headers = wire.replay_headers(message.headers)
            properties = wire.republish_properties(message.properties, headers, userid=userid)
            address = topology.address(message.queue, 0)
            confirmer.publish(Message(message.body, **properties), address.exchange, address.routing_key,
                              on_ok=_acker(channel, message, replayed),
                              on_fail=partial(_keeper, kept, message))
        while confirmer.pending:
            connection.drain_events(timeout=30)
        return replayed, kept
    finally:
        channel.close()


def _keeper(kept: list[tuple[ArchivedMessage, str]], message: ArchivedMessage, why: str) -> None:
    kept.append((message, why))


def _acker(channel: Any, message: ArchivedMessage, replayed: list[ArchivedMessage]) -> Callable[[], None]:
    def ack() -> None:
        channel.basic_ack(message.delivery_tag)
        replayed.append(message)
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
