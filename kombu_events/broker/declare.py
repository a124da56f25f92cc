"""Declare a topology on the broker, idempotently; conflicts become TopologyConflictError.

Also the passive declares that read what the broker holds without changing it: the
counts of queues (:func:`peek_queues`, :func:`peek_queue`, :func:`queue_counts` on a
channel of the caller's) and the exchanges it lacks (:func:`absent_exchanges`).
"""
from __future__ import annotations

__all__ = ["declare", "declare_queue", "tolerated", "conflict_error", "QueueCounts", "queue_counts", "peek_queues",
           "peek_queue", "absent_exchanges", "close_quietly", "open_archive", "log_legacy_archive", "require_plugins",
           "ARCHIVE_RETENTION"]

import logging
import re
from typing import Any, Callable, Iterable, NamedTuple, TypeVar

from amqp import Message
from amqp.exceptions import InvalidCommand, NotFound, PreconditionFailed
from kombu import Exchange, Queue

from ..core import ordering
from ..core.archive_records import OPENED, settlement_record
from ..core.topology import TYPE_ARGUMENTS, Topology
from ..errors import PluginMissingError, TopologyConflictError
from .confirms import Confirmer
from .streams import NotAStreamError, last_chunk_offset

logger = logging.getLogger(__name__)

_INEQUIVALENT = re.compile(r"inequivalent arg '([^']+)' for (queue|exchange) '([^']+)'")
_INVALID = re.compile(r"invalid arg '([^']+)' for (queue|exchange) '([^']+)'")


def conflict_error(exc: PreconditionFailed, kind: str, name: str, role: str | None = None) -> TopologyConflictError:
    """A clear error for a PRECONDITION_FAILED on declaring ``kind`` ``name`` (``role``: the topology's for it)."""
    text = str(getattr(exc, "reply_text", "") or exc)
    invalid = _INVALID.search(text)
    if invalid:  # not a conflict: RabbitMQ refuses the value itself
        return TopologyConflictError(f"RabbitMQ refused argument {invalid.group(1)!r} of {kind} {name!r}: {text}. "
                                     "Change the setting that produces it.", entity=name, argument=invalid.group(1))
    found = _INEQUIVALENT.search(text)
    argument = found.group(1) if found else None
    what = f"argument {argument!r}" if argument else "set of arguments"
    fix = "Delete it (after draining it) or align the settings, then declare again."
    if role == "log":  # a stream keeps the retention it was made with; migrate moves queues, not logs
        fix = ("A log's stream keeps the retention it was made with: give the log a new `name=` (the old stream "
               "stays until you delete it), or delete the stream, and every event it holds, to declare it anew "
               "(docs/logs.md).")
    elif kind == "queue":  # the queue type, or any argument: migrate recreates it with its messages
        fix += (" To recreate the service's queues with their messages (from classic to quorum, or back), stop its "
                "workers and run `kombu-events migrate --to quorum` (or `--to classic`).")
    return TopologyConflictError(f"{kind} {name!r} already exists on the broker with a different {what}: {text}. {fix}",
                                 entity=name, argument=argument)


def declare(topology: Topology, connection: Any) -> dict[str, int]:
    """Declare every entity of ``topology`` on a fresh channel of ``connection``; return counts.

    A queue that exists with other arguments is a TopologyConflictError, except where
    :func:`tolerated` says the difference is one kombu-events accepts (then it is kept as it is).
    """
    require_plugins(topology, connection)
    channel = connection.channel()
    try:
        counts = {"exchanges": 0, "queues": 0, "bindings": 0, "exchange_bindings": 0}
        for exchange in topology.exchanges:
            _guard("exchange", exchange.name, exchange.bind(channel).declare)
            counts["exchanges"] += 1
        kept: list[str] = []
        opened = False
        for queue in topology.queues:
            if topology.role(queue.name) == "archive" and peek_queue(connection, queue.name) is None:
                opened = True  # made now: its first record says so (docs/failures.md)
            channel = _declare_queue(topology, connection, channel, queue, kept)
            bound = queue.bind(channel)
            for b in queue.bindings:
                bound.bind_to(exchange=b.exchange.name, routing_key=b.routing_key)
                counts["bindings"] += 1
            counts["queues"] += 1
        for link in topology.exchange_bindings:
            link.destination.bind(channel).bind_to(exchange=link.source.name, routing_key=link.routing_key)
            counts["exchange_bindings"] += 1
        if opened:
            open_archive(topology, connection)
        kept = [name for name in kept if topology.shared(name)]
        if kept:
            logger.info("kombu-events: %d queues shared by every service on exchange %s exist with another queue "
                        "type (another service declared them first): kept as they are", len(kept),
                        topology.settings.exchange)
        logger.info("declared topology of service %s: %s", topology.settings.service, counts)
        return counts
    finally:
        close_quietly(channel)  # a failed declare already closed it


def require_plugins(topology: Topology, connection: Any) -> None:
    """PluginMissingError unless the broker has the exchange types ``topology`` needs (an ordered handler's
    consistent-hash exchange). Declared first on a connection of their own: an unknown exchange type is a
    connection error, which would end the caller's connection (a worker's: Celery's own)."""
    hashed = [exchange for exchange in topology.exchanges if exchange.type == ordering.HASH_EXCHANGE_TYPE]
    if not hashed:
        return
    probe = connection.clone()
    try:
        channel = probe.channel()
        for exchange in hashed:
            try:
                _guard("exchange", exchange.name, exchange.bind(channel).declare)
            except InvalidCommand as exc:
                if "unknown exchange type" not in str(exc):
                    raise
                raise PluginMissingError(
                    f"exchange {exchange.name!r} of an ordered handler (ordered_by=, partitions=) needs RabbitMQ's "
                    f"{ordering.PLUGIN} plugin, which this broker has not enabled: run `rabbitmq-plugins enable "
                    f"{ordering.PLUGIN}` on every node of the cluster (it ships with RabbitMQ), then start the "
                    f"worker again (docs/ordering.md)") from None
    finally:
        probe.release()


def tolerated(topology: Topology, queue: str) -> frozenset[str]:
    """The arguments in which an existing ``queue`` may differ from the topology's and be kept as it is.

    A queue of the exchange's shared ladder keeps the type (and what follows from it) of the
    service that declared it first, so that classic and quorum services share an exchange. A
    quorum queue made before kombu-events set ``x-delivery-limit`` keeps working without it
    (a warning says what RabbitMQ 4 then does).
    """
    if topology.shared(queue):
        return TYPE_ARGUMENTS
    if topology.role(queue) == "archive":
        return ARCHIVE_RETENTION
    return frozenset({"x-delivery-limit"})


#: The archive stream's retention, fixed when it was made: `kombu-events archive rewrite` makes it again with the
#: settings' (a stream keeps the arguments it was made with).
ARCHIVE_RETENTION = frozenset({"x-max-age", "x-max-length-bytes", "x-stream-max-segment-size-bytes"})


def _declare_queue(topology: Topology, connection: Any, channel: Any, queue: Any, kept: list[str]) -> Any:
    """Declare ``queue`` on ``channel``; return the channel to go on with (a new one after a tolerated
    conflict, whose queue's name goes in ``kept``)."""
    try:
        queue.bind(channel).queue_declare()
        return channel
    except PreconditionFailed as exc:
        found = _INEQUIVALENT.search(str(getattr(exc, "reply_text", "") or exc))
        legacy = bool(found) and topology.role(queue.name) == "archive" and _is_legacy_archive(connection, queue.name)
        allowed = tolerated(topology, queue.name)
        if not legacy and (not found or found.group(1) not in allowed):
            raise conflict_error(exc, "queue", queue.name, topology.role(queue.name)) from exc
        differing = found.group(1) if found else "type"
    close_quietly(channel)
    channel = connection.channel()
    if topology.shared(queue.name) or topology.role(queue.name) == "archive":
        # Of the other type: a quorum queue also checks arguments the request lacks, so only that it exists.
        channel.queue_declare(queue.name, passive=True)
    else:  # declared again without the limit: any other difference is still a conflict
        rest = {k: v for k, v in (queue.queue_arguments or {}).items() if k not in allowed}
        again = Queue(queue.name, durable=queue.durable, auto_delete=queue.auto_delete, queue_arguments=rest)
        _guard("queue", queue.name, again.bind(channel).queue_declare)
    kept.append(queue.name)
    _log_kept(topology, queue.name, differing, legacy=legacy)
    return channel


def open_archive(topology: Topology, connection: Any, *, timeout_s: float = 30.0) -> None:
    """Write the first record of a new archive stream, an ``opened`` settlement that names no copy: a reader
    finds the end of a stream from its last record, and this one makes the archive never empty."""
    channel = connection.channel()
    try:
        confirmer = Confirmer(channel)
        body, properties = settlement_record(OPENED, (), by=getattr(connection, "userid", None),
                                             note="archive stream created")
        failed: list[str] = []
        confirmer.publish(Message(body, **properties), topology.archive_exchange, "", on_ok=lambda: None,
                          on_fail=failed.append)
        confirmer.wait(timeout_s=timeout_s)
        if failed or confirmer.pending:
            logger.warning("kombu-events: the first record of the new archive %s was not confirmed (%s): a read of "
                           "the empty archive waits a few seconds for its end", topology.archive_exchange,
                           failed[0] if failed else "no confirm")
    finally:
        close_quietly(channel)


def _is_legacy_archive(connection: Any, name: str) -> bool:
    """Whether the archive ``name`` is a queue of an earlier version (the broker refuses a stream offset on it:
    nothing in it moves)."""
    try:
        last_chunk_offset(connection, name, wait_s=0.0)
    except NotAStreamError:
        return True
    return False


def log_legacy_archive(queue: str, argument: str) -> None:
    """The WARNING for an archive of an earlier version, kept as it is (declare, and a check without declaring)."""
    logger.warning("kombu-events: the archive %s is a queue of an earlier kombu-events version (it differs in %s), "
                   "not a stream: it is kept and still takes archived messages, but `archive list` and the console "
                   "refuse to read it (a read would change it). Move it to a stream with its messages: "
                   "`kombu-events migrate --archive`", queue, argument)


def _log_kept(topology: Topology, queue: str, argument: str, *, legacy: bool = False) -> None:
    if topology.role(queue) == "archive" and not legacy:
        logger.warning("kombu-events: the archive stream %s was made with another %s than the settings give: a "
                       "stream keeps the retention it was made with, so it is kept as it is. `kombu-events archive "
                       "rewrite` makes it again, with its records and the settings' retention", queue, argument)
        return
    if topology.role(queue) == "archive":
        log_legacy_archive(queue, argument)
        return
    if topology.shared(queue):
        logger.debug("kombu-events: shared queue %s exists with another %s: kept as it is", queue, argument)
        return
    logger.warning("kombu-events: quorum queue %s has no x-delivery-limit of kombu-events' (it was declared by an "
                   "older version): on RabbitMQ 4 the broker dead-letters, or drops, a message at its 20th "
                   "delivery. Recreate the service's queues with their messages to set it: stop its workers and run "
                   "`kombu-events migrate --to quorum`", queue)


def _guard(kind: str, name: str, fn: Any) -> None:
    try:
        fn()
    except PreconditionFailed as exc:
        raise conflict_error(exc, kind, name) from exc


def declare_queue(channel: Any, queue: Any) -> None:
    """Declare one unbound kombu ``queue`` of a topology (no bindings) on ``channel``, e.g. one that expired."""
    _guard("queue", queue.name, queue.bind(channel).queue_declare)


class QueueCounts(NamedTuple):
    """What a passive ``queue.declare`` answers about a queue: its ready messages and its consumers."""

    messages: int
    consumers: int


def queue_counts(channel: Any, name: str) -> QueueCounts:
    """The counts of queue ``name``, by a passive declare on ``channel`` (the caller's, left open).

    Raises amqp's NotFound when the queue does not exist; the broker then closes
    ``channel`` (py-amqp reopens it: the caller still closes it).
    """
    _name, messages, consumers = channel.queue_declare(name, passive=True)
    return QueueCounts(messages, consumers)


def peek_queues(connection: Any, names: Iterable[str]) -> dict[str, QueueCounts | None]:
    """The counts of each queue of ``names``, None for one that does not exist; nothing is created.

    One passive ``queue.declare`` per queue, all on one channel of ``connection`` until
    a missing queue makes the broker close it; the next queue gets a fresh one. Every
    channel opened here is closed here (a failure to close is logged at debug).
    """
    return dict(_passive(connection, names, queue_counts))


def peek_queue(connection: Any, name: str) -> QueueCounts | None:
    """The counts of queue ``name``, None if it does not exist (a passive declare on a channel of its own)."""
    return peek_queues(connection, [name])[name]


def absent_exchanges(connection: Any, exchanges: Iterable[Exchange]) -> list[str]:
    """Names of the ``exchanges`` the broker does not have, in their order (passive declares, channels as
    :func:`peek_queues` uses them)."""
    return [exchange.name for exchange, found in _passive(connection, exchanges, _exchange_exists) if found is None]


def close_quietly(channel: Any) -> None:
    """Close ``channel``; a failure (the connection went away meanwhile) is logged at debug, never raised."""
    try:
        channel.close()
    except Exception as exc:
        logger.debug("kombu-events: closing a channel failed: %s", exc)


def _exchange_exists(channel: Any, exchange: Exchange) -> bool:
    channel.exchange_declare(exchange.name, exchange.type, passive=True)
    return True


_Key = TypeVar("_Key")
_Found = TypeVar("_Found")


def _passive(connection: Any, keys: Iterable[_Key],
             look: Callable[[Any, _Key], _Found]) -> list[tuple[_Key, _Found | None]]:
    """``look(channel, key)`` for each of ``keys``, None where it raised NotFound; one channel until a 404."""
    found: list[tuple[_Key, _Found | None]] = []
    channel = None
    try:
        for key in keys:
            if channel is None:
                channel = connection.channel()
            try:
                found.append((key, look(channel, key)))
            except NotFound:
                found.append((key, None))
                # The broker closed the channel; py-amqp reopens it at once, so it is closed here, or it
                # would stay open for as long as the connection (a worker's, for the depth gauges).
                close_quietly(channel)
                channel = None
    finally:
        if channel is not None:
            close_quietly(channel)
    return found
