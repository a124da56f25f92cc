"""``kombu-events migrate --archive``: an earlier version's archive (a classic or quorum queue) into the
archive stream of the same name, losing nothing, while workers keep archiving (docs/rabbitmq-versions.md).

The messages go through ``<archive>.moving``, as :mod:`kombu_events.ops.migrate` moves a handler
queue: :func:`archive_steps` (pure) turns what :func:`observe_archive` reads into the steps, and
:func:`move_archive` carries them out. A copy the stream already holds (by archive key, or by content
for a copy without one) is acked without being copied again.
"""
from __future__ import annotations

__all__ = ["ARCHIVE_SUFFIX", "ArchiveState", "archive_holding_name", "archive_steps", "observe_archive",
           "move_archive"]

import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from kombu import Queue

from ..broker import streams
from ..broker.declare import close_quietly, peek_queues
from ..broker.stream_headers import pack
from ..core.archive_records import OPENED, settlement_record
from ..core.wire import ARCHIVE_KEY, PACKED_HEADERS, new_archive_key
from .archive_rewrite import SETTLE_S, Seen, StreamWriter, content_digest
from .migrate import MigrationError, MigrationStep, QueueState, copy_properties, delete_when_empty, move, observed_state

logger = logging.getLogger(__name__)

#: The holding queue of an archive being moved to a stream.
ARCHIVE_SUFFIX = ".moving"


def archive_holding_name(archive: str) -> str:
    """The classic queue that holds the archive's messages while the stream is made."""
    return archive + ARCHIVE_SUFFIX


@dataclass(frozen=True)
class ArchiveState:
    """The archive on the broker: ``kind`` is missing, queue (an earlier version's) or stream; its holding queue."""

    kind: str
    holding: QueueState
    messages: int = 0
    consumers: int = 0


def archive_steps(archive: str, state: ArchiveState) -> list[MigrationStep]:
    """The steps that move ``archive`` into a stream from ``state`` (pure; empty when there is nothing to do).

    Raises MigrationError, before any step, when the old archive or the holding queue has consumers.
    """
    hold = state.holding
    busy = [f"{name} ({n})" for name, n in ((archive, state.consumers), (hold.name, hold.consumers)) if n]
    if busy:
        raise MigrationError(f"consumers are attached to {', '.join(busy)}: stop whatever reads the archive "
                             "(nothing was changed)")
    steps: list[MigrationStep] = []
    if state.kind == "queue":
        if not hold.exists:
            steps.append(MigrationStep("declare-holding", hold.name))
        steps += [MigrationStep("bind", hold.name), MigrationStep("unbind", archive),
                  MigrationStep("move", hold.name, source=archive, messages=state.messages),
                  MigrationStep("delete", archive)]
    elif not hold.exists:
        return []  # a stream already, or no archive yet (declare makes it a stream)
    if state.kind != "stream":
        steps.append(MigrationStep("declare-stream", archive))
    back = hold.messages + (state.messages if state.kind == "queue" else 0)
    return [*steps, MigrationStep("fill", archive, source=hold.name, messages=back), MigrationStep("delete", hold.name)]


def observe_archive(connection: Any, archive: str) -> ArchiveState:
    """The archive's and its holding queue's state (passive declares; a stream offset tells a stream)."""
    counts = peek_queues(connection, [archive, archive_holding_name(archive)])
    hold = observed_state(connection, archive_holding_name(archive), counts[archive_holding_name(archive)], None)
    found = counts[archive]
    if found is None:
        return ArchiveState("missing", hold)
    try:
        streams.last_chunk_offset(connection, archive, wait_s=0.0)
    except streams.NotAStreamError:
        return ArchiveState("queue", hold, messages=found.messages, consumers=found.consumers)
    return ArchiveState("stream", hold)


class _IntoStream:
    """Makes each copy a message of the holding queue becomes in the archive stream: its archive key stamped
    when it has none, its header table packed as the worker packs it (a stream drops arrays and tables:
    :mod:`kombu_events.broker.stream_headers`); a message the
    stream already holds (a crash between a confirm and its ack, or the switch of bindings) is dropped."""

    def __init__(self, seen: Any, userid: str | None) -> None:
        self.seen, self.userid = seen, userid
        self.taken: list[bytes] = []  # content digests of every message taken from the holding queue
        self.copied = self.duplicates = 0

    def __call__(self, message: Any) -> tuple[bytes, dict[str, Any]] | None:
        headers = dict(message.properties.get("application_headers") or {})
        body = streams.body_of(message)
        self.taken.append(content_digest(headers, message.properties, body))
        if self.seen.has(headers, message.properties, body):
            self.duplicates += 1
            return None
        headers.setdefault(ARCHIVE_KEY, new_archive_key())
        if PACKED_HEADERS not in headers:  # archived by an earlier version: every header in the clear
            headers = pack({"application_headers": headers})["application_headers"]
        properties = copy_properties({**message.properties, "application_headers": headers}, self.userid)
        self.seen.add(headers, properties, body)
        self.copied += 1
        return body, properties


def move_archive(connection: Any, topology: Any, steps: Sequence[MigrationStep],
                 report: Callable[[str], Any] = logger.info) -> dict[str, int]:
    """Carry out :func:`archive_steps`; counts: ``old_queue`` (messages taken from the old archive),
    ``taken`` (from the holding queue), ``copied``, ``duplicates`` (dropped: already in the stream) and
    ``verified`` (of those taken, found in the stream by a read after the move)."""
    archive = topology.archive_exchange
    queue = next(q for q in topology.queues if q.name == archive)
    into = _IntoStream(Seen(), getattr(connection, "userid", None))
    counts = {"old_queue": 0}
    for step in steps:
        report(step.describe())
        if step.action == "move":
            counts["old_queue"] += move(connection, step.source, step.queue)
            report(f"  moved {counts['old_queue']} message(s)")
        elif step.action == "delete" and step.queue == archive:
            counts["old_queue"] += delete_when_empty(connection, archive, report,
                                                      target=archive_holding_name(archive))
        elif step.action == "delete":
            delete_when_empty(connection, step.queue, report, target=archive, copy=into)
        elif step.action == "fill":
            _fill(connection, topology, archive, step.source, into)
            report(f"  copied {into.copied} message(s), {into.duplicates} already in the stream")
        else:
            channel = connection.channel()
            try:
                _archive_entity(channel, step, queue)
            finally:
                close_quietly(channel)
    counts.update(taken=len(into.taken), copied=into.copied, duplicates=into.duplicates,
                  verified=_verified(connection, archive, into.taken))
    return counts


def _archive_entity(channel: Any, step: MigrationStep, queue: Queue) -> None:
    """A declare, bind or unbind step of the archive's move (one fanout binding, routing key "")."""
    exchange = queue.name  # the archive exchange has the archive's name
    if step.action == "declare-holding":
        channel.queue_declare(step.queue, durable=True, auto_delete=False, arguments={"x-queue-type": "classic"})
    elif step.action == "declare-stream":
        queue.bind(channel).queue_declare()
    elif step.action == "bind":
        channel.queue_bind(step.queue, exchange=exchange, routing_key="")
    else:
        channel.queue_unbind(step.queue, exchange=exchange, routing_key="")


def _fill(connection: Any, topology: Any, archive: str, holding: str, into: _IntoStream) -> None:
    """Copy the holding queue into the stream, then give the stream the binding (see the module)."""
    channel = connection.channel()
    try:
        channel.queue_bind(holding, exchange=archive, routing_key="")  # the holding queue alone takes new ones
        channel.queue_unbind(archive, exchange=archive, routing_key="")
        if streams.last_chunk_offset(connection, archive, wait_s=1.0) is None:
            _write_opened(connection, archive)
        into.seen.read(connection, archive)
        move(connection, holding, archive, copy=into)
        mark = streams.last_chunk_offset(connection, archive, wait_s=1.0)
        channel.queue_bind(archive, exchange=archive, routing_key="")
        channel.queue_unbind(holding, exchange=archive, routing_key="")
        time.sleep(SETTLE_S)  # a message routed to both before the unbind is in the stream by then
        into.seen.read(connection, archive, start="first" if mark is None else mark)
        move(connection, holding, archive, copy=into)
    finally:
        close_quietly(channel)


def _write_opened(connection: Any, archive: str) -> None:
    """The stream's first record: an ``opened`` settlement (readers find the end of a stream from its last)."""
    body, properties = settlement_record(OPENED, (), by=getattr(connection, "userid", None),
                                         note="archive moved from a queue of an earlier version")
    writer = StreamWriter(connection, archive)
    try:
        writer.put(body, properties)
        writer.flush()
    finally:
        writer.close()


def _verified(connection: Any, archive: str, taken: list[bytes]) -> int:
    """How many of the ``taken`` messages (content digests) a read of the whole stream finds."""
    if not taken:
        return 0
    found = Seen()
    found.read(connection, archive)
    return sum(1 for digest in taken if digest in found.digests)
