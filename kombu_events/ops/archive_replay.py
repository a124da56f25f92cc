"""Replay of archived copies: each copy built apart (pure), then sent a window at a time and settled.

A window of copies is published to their queues with publisher confirms (mandatory); those the broker
confirmed are then settled by one ``replayed`` record, itself confirmed, before the next window (see
:mod:`kombu_events.ops.archive`, which re-exports the public names of this module).
"""
from __future__ import annotations

__all__ = ["ReplayProgress", "ReplayCopy", "ORIGINAL_ID", "RECONNECTABLE", "replay", "replay_copy",
           "replay_reconnecting"]

import hashlib
import logging
import time
import uuid
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable, Iterable, Iterator, Mapping

from amqp import Message, exceptions as amqp_errors

from ..broker.confirms import Confirmer
from ..broker.declare import close_quietly, peek_queue
from ..core import archive_records as records_, wire
from ..core.topology import Topology
from ..errors import BrokerUnavailableError, KombuEventsError
from .archive_read import ArchivedMessage, ArchiveMissingError, pending_matching, view, view_through, whole_copies

logger = logging.getLogger(__name__)

#: On an edited copy (``replay(edits=...)``): the message id of the archived original.
ORIGINAL_ID = wire.PREFIX + "original-id"

#: Copies a replay sends before it waits for their confirms and writes their settlement.
_REPLAY_WINDOW = 200
#: What a replay may go on from on a new connection, with its ReplayProgress: a lost connection, and an archive
#: not found (a broker just started again takes a moment to bring its streams back).
RECONNECTABLE = (amqp_errors.ConnectionError, amqp_errors.RecoverableConnectionError, OSError, BrokerUnavailableError,
                 ArchiveMissingError)


@dataclass
class ReplayProgress:
    """What one replay did, counted across connections (the console's job shows it)."""

    #: Copies confirmed by the broker and settled, over every connection.
    copies_confirmed: int = 0
    #: Settlement records written, over every connection.
    commits: int = 0
    #: Archive keys settled so far (a replay run again after a lost connection skips them).
    settled: set[str] = field(default_factory=set)
    #: The last archive offset the first run read (-1: the archive was empty; None: not read yet): a run again
    #: selects nothing archived after it.
    through: int | None = None


@dataclass(frozen=True)
class ReplayCopy:
    """What the replay of one archived copy publishes: where, and the body and properties it carries."""

    message: ArchivedMessage
    queue: str
    exchange: str
    routing_key: str
    body: bytes
    properties: dict[str, Any]


def replay_copy(message: ArchivedMessage, topology: Topology, *, to_queue: str | None = None,
                stamp: Mapping[str, Any] | None = None, edits: Mapping[str, bytes] | None = None,
                userid: str | None = None) -> ReplayCopy:
    """The copy of ``message`` a replay sends to ``to_queue`` (default: its own queue) through the service's
    delivery exchange: replay headers, ``stamp`` added; an edited body (``edits``, by archive key) under a
    message id derived from the key and that body, the original's id in :data:`ORIGINAL_ID`."""
    queue = to_queue or message.queue
    address = topology.address(queue, 0)
    headers = {**wire.replay_headers(message.headers, archive_key=message.key), **(stamp or {})}
    edited = edits.get(message.key) if edits is not None else None
    if edited is not None:
        headers[ORIGINAL_ID] = message.id
    properties = wire.republish_properties(message.properties, headers, userid=userid)
    body = message.body
    if edited is not None:
        digest = hashlib.sha256(message.key.encode() + b"\0" + edited).hexdigest()
        properties["message_id"] = str(uuid.uuid5(uuid.NAMESPACE_URL, f"kombu-events:edit:{digest}"))
        body = edited
    return ReplayCopy(message, queue, address.exchange, address.routing_key, body, properties)


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
    if progress is None:
        chosen = pending_matching(view(connection, topology, body_limit=match_body, full=False, start=start), match,
                                  limit)
    else:  # run again after a lost connection: what the first run selected, less what it settled
        chosen = _pinned_selection(connection, topology, match, limit, progress, match_body, start)
    sendable, kept = _sendable(connection, topology, chosen, to_queue)
    replayed: list[ArchivedMessage] = []
    if not sendable:
        return replayed, kept
    sender = _Sender(connection, topology, by, confirm_timeout_s, on_window)
    build = partial(replay_copy, topology=topology, to_queue=to_queue, stamp=dict(stamp or {}), edits=edits,
                    userid=sender.userid)
    try:
        for batch in _windows(whole_copies(connection, topology, sendable), window):
            sender.send([build(message) for message in batch], replayed, kept, progress)
    finally:
        sender.close()
    replayed.sort(key=lambda m: m.offset)
    return replayed, kept


def replay_reconnecting(connect: Callable[[], AbstractContextManager[Any]], topology: Topology,
                        match: Callable[[ArchivedMessage], bool], limit: int | None = None, *,
                        on_window: Callable[[list[ArchivedMessage]], Any] | None = None,
                        on_lost: Callable[[int, BaseException, int], Any] | None = None, reconnects: int = 30,
                        delay_s: float = 0.5) -> tuple[list[ArchivedMessage], list[tuple[ArchivedMessage, str]]]:
    """:func:`replay` on a connection from ``connect()``; one lost once the replay has begun is made again (up to
    ``reconnects`` times, ``on_lost(count, error, settled so far)`` each time, waiting ``delay_s`` more each time,
    at most 5 s), and the replay goes on with what it selected first, less what it settled: a copy confirmed and
    not settled when the connection went is sent again, under its archive key. A failure to connect at first, or
    an archive missing at the first try (not after a lost connection: a broker just started again brings its
    streams back a moment later), raises at once. (replayed in stream order, [(kept, why)])."""
    progress = ReplayProgress()
    replayed: list[ArchivedMessage] = []

    def settled(copies: list[ArchivedMessage]) -> None:
        replayed.extend(copies)
        if on_window is not None:
            try:
                on_window(copies)
            except Exception as exc:  # the caller's (say a closed stdout): never taken for a lost connection
                raise _CallerFailed(exc) from exc

    began, lost = False, 0
    while True:
        try:
            with connect() as conn:
                began = True
                try:
                    _, kept = replay(conn, topology, match, limit, progress=progress, on_window=settled)
                except KombuEventsError as exc:  # the confirms never came: from a connection that went away?
                    if isinstance(exc, RECONNECTABLE) or conn.connected:
                        raise
                    raise BrokerUnavailableError(f"the connection was lost during the replay: {exc}") from exc
            return sorted(replayed, key=lambda m: m.offset), kept
        except _CallerFailed as failed:
            raise failed.error from None
        except RECONNECTABLE as exc:
            if not began or (isinstance(exc, ArchiveMissingError) and progress.through is None and not lost):
                raise
            lost += 1
            if lost > reconnects:
                raise KombuEventsError(
                    f"the connection to the broker was lost {lost} time{'s' if lost != 1 else ''} "
                    f"({type(exc).__name__}: {exc}); {len(progress.settled)} replayed and settled. Run the replay "
                    "again for the rest: a copy sent and not settled when the connection went is sent again under "
                    "its archive key (a once=True handler runs it once)") from exc
            if on_lost is not None:
                on_lost(lost, exc, len(progress.settled))
            time.sleep(min(delay_s * lost, 5.0))


class _CallerFailed(Exception):
    """What ``on_window`` raised, carried out of the replay as itself (see :func:`replay_reconnecting`)."""

    def __init__(self, error: Exception) -> None:
        super().__init__(str(error))
        self.error = error


def _pinned_selection(connection: Any, topology: Topology, match: Callable[[ArchivedMessage], bool],
                      limit: int | None, progress: ReplayProgress, match_body: int, start: int | str,
                      ) -> list[ArchivedMessage]:
    """The copies a run of a replay with ``progress`` sends: those that ``match`` and were archived at most up to
    the offset the first run read through, none settled by an earlier run, at most ``limit`` over every run."""
    fold, reached = view_through(connection, topology, body_limit=match_body, full=False, start=start)
    if progress.through is not None:
        match = partial(_unsettled, progress.settled, partial(_at_most, progress.through, match))
    left = None if limit is None else limit - len(progress.settled)
    chosen = pending_matching(fold, match, left)
    if progress.through is None:  # as a dry run pins (archive_read.selected): a limit stops at its last copy
        full = limit is not None and chosen and len(chosen) >= limit
        progress.through = chosen[-1].offset if full else reached if reached is not None else -1
    return chosen


def _at_most(through: int, match: Callable[[ArchivedMessage], bool], message: ArchivedMessage) -> bool:
    return message.offset <= through and match(message)


def _unsettled(settled: set[str], match: Callable[[ArchivedMessage], bool], message: ArchivedMessage) -> bool:
    return message.key not in settled and match(message)


def _sendable(connection: Any, topology: Topology, chosen: list[ArchivedMessage], to_queue: str | None,
              ) -> tuple[list[ArchivedMessage], list[tuple[ArchivedMessage, str]]]:
    """``chosen`` split in two: the copies their queue (or ``to_queue``) can take, and the others with why not."""
    handler_queues = {q.name for q in topology.queues if topology.role(q.name) in ("handler", "schedule")}
    readers = {r.queue for r in topology.readers}
    why_not: dict[str, str | None] = {}
    sendable: list[ArchivedMessage] = []
    kept: list[tuple[ArchivedMessage, str]] = []
    for message in chosen:
        queue = to_queue or message.queue
        if queue not in why_not:
            why_not[queue] = (f"{queue!r} is a reader of a log, which takes no events: `kombu-events log rewind` "
                              "runs its events again (or replay it to a handler's queue from the console)"
                              if queue in readers else _unsendable(connection, queue, handler_queues))
        reason = why_not[queue]
        if reason is None:
            sendable.append(message)
        else:
            kept.append((message, reason))
    return sendable, kept


def _unsendable(connection: Any, queue: str, handler_queues: set[str]) -> str | None:
    """Why a copy cannot be sent to ``queue`` (not this service's, or not on the broker), else None."""
    if queue not in handler_queues:
        return f"queue {queue!r} is not a queue of this service"
    if peek_queue(connection, queue) is None:
        return f"queue {queue!r} does not exist on the broker (declare it, or replay to another queue)"
    return None


def _windows(messages: Iterable[ArchivedMessage], size: int) -> Iterator[list[ArchivedMessage]]:
    """``messages`` in lists of ``size`` (the last one shorter), taken from ``messages`` as they come."""
    batch: list[ArchivedMessage] = []
    for message in messages:
        batch.append(message)
        if len(batch) >= size:
            yield batch
            batch = []
    if batch:
        yield batch


class _Sender:
    """Publishes replayed copies and settlement records on one confirm channel."""

    def __init__(self, connection: Any, topology: Topology, by: str | None, timeout_s: float,
                 on_window: Callable[[list[ArchivedMessage]], Any] | None = None) -> None:
        self.topology = topology
        self.on_window = on_window
        self.userid = getattr(connection, "userid", None)
        self.by = by or self.userid or ""
        self.timeout_s = timeout_s
        self.channel = connection.channel()
        self.confirmer = Confirmer(self.channel)

    def close(self) -> None:
        close_quietly(self.channel)

    def send(self, copies: list[ReplayCopy], replayed: list[ArchivedMessage],
             kept: list[tuple[ArchivedMessage, str]], progress: ReplayProgress | None) -> None:
        """Publish ``copies``, wait for their confirms, then settle those confirmed (one record)."""
        confirmed: list[tuple[ArchivedMessage, str]] = []
        for copy in copies:
            self.confirmer.publish(Message(copy.body, **copy.properties), copy.exchange, copy.routing_key,
                                   on_ok=partial(confirmed.append, (copy.message, copy.queue)),
                                   on_fail=partial(_kept_because, kept, copy.message))
        self._wait("the replayed copies")
        if not confirmed:
            return
        keys = self._settle(confirmed)
        replayed.extend(m for m, _ in confirmed)
        if progress is not None:
            progress.copies_confirmed += len(confirmed)
            progress.commits += 1
            progress.settled.update(keys)
        logger.info("kombu-events: replayed %d archived cop%s of %s (settled by %s)", len(keys),
                    "y" if len(keys) == 1 else "ies", self.topology.settings.service, self.by or "?")
        if self.on_window is not None:
            self.on_window([m for m, _ in confirmed])

    def _settle(self, confirmed: list[tuple[ArchivedMessage, str]]) -> list[str]:
        """Write the ``replayed`` record of the ``confirmed`` copies (and their queues), confirmed; their keys."""
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
        return keys

    def _wait(self, what: str) -> None:
        self.confirmer.wait(timeout_s=self.timeout_s, reraise=True)  # a lost connection raises as itself
        if self.confirmer.pending:
            raise KombuEventsError(f"the broker confirmed none of {what} in {self.timeout_s:g} s "
                                   f"({self.confirmer.pending} waiting); nothing was settled")


def _kept_because(kept: list[tuple[ArchivedMessage, str]], message: ArchivedMessage, why: str) -> None:
    kept.append((message, f"copy {why}; kept archived"))
