"""What each log of events of a service holds (``kombu-events log status``): its binding keys and retention, its
first and last offset and their times, read from the stream without changing it, and what the management API adds.

The offsets are read over AMQP (:mod:`kombu_events.broker.streams`): a consumer at ``first`` takes one
message, a read of the last chunk gives the last one; a stream numbers its messages one by one, so it holds
about ``last - first + 1`` (the broker numbers a record of its own at the start of some segments too). A
message's time is its ``timestamp`` property, which kombu-events' publisher sets (whole seconds); a publisher
that sets none leaves it unknown. The management API (when it answers) adds the count of segments the stream
keeps on disk (RabbitMQ 4; 3.10 does not say).
"""
from __future__ import annotations

__all__ = ["LogStatus", "Position", "ReaderStatus", "gather_logs", "position_of", "reader_status", "readers_of"]

import logging
from collections import deque
from contextlib import closing
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from typing import Any, Generator, cast

from amqp.exceptions import NotFound

from ..broker.declare import peek_queue
from ..broker.reader_records import peek_position
from ..broker.streams import follow, last_chunk_offset, read
from ..core.config import management_base_url
from ..core.event_log import EventLog, max_age
from ..core.readers import Reader
from ..core.topology import Topology
from .status import queue_statistics

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Position:
    """One message of a stream: its offset, and its ``timestamp`` property as ISO 8601 UTC (None: not set)."""

    offset: int
    timestamp: str | None


@dataclass
class ReaderStatus:
    """One reader of a log: its position (the next offset it reads), how far behind the log's last event it is,
    whether a worker holds its lock, and rewind requests not yet taken."""

    name: str
    queue: str
    position: int | None
    generation: int | None
    lag: int | None
    reading: bool | None
    rewinds_waiting: int | None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class LogStatus:
    """One log: what the code declares, and what the broker holds (None where it could not say)."""

    name: str
    queue: str
    binding_keys: list[str]
    max_age: str | None
    max_bytes: int | None
    segment_bytes: int
    exists: bool
    messages: int | None
    first: Position | None
    last: Position | None
    consumers: int | None
    segments: int | None
    management: bool
    readers: list[ReaderStatus] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        """JSON-friendly form."""
        return asdict(self)


def gather_logs(connection: Any, topology: Topology, management_url: str | None = None, *,
                wait_s: float = 2.0) -> list[LogStatus]:
    """The status of every log of ``topology``, in the order they were declared; the management API is asked at
    ``management_url``, else at the service's ``management_url`` setting, else on the broker's host."""
    base_url = management_base_url(management_url or topology.settings.management_url, connection.hostname)
    found = []
    use_api = True
    for log in topology.logs:
        api = queue_statistics(connection, log.queue, base_url) if use_api else None
        use_api = api is not None  # one that does not answer is not asked again for each log
        row = _status(connection, log, api, wait_s)
        row.readers = [reader_status(connection, r, row.last, row.first)
                       for r in topology.readers if r.log.name == log.name]
        found.append(row)
    return found


def readers_of(connection: Any, topology: Topology, *, wait_s: float = 2.0) -> list[ReaderStatus]:
    """The status of every reader of ``topology`` (each log's last offset read once), in registration order."""
    ends_of = {log.name: position_of(connection, log.queue, wait_s=wait_s)
               for log in topology.logs if any(r.log.name == log.name for r in topology.readers)}
    return [reader_status(connection, r, ends_of[r.log.name][1], ends_of[r.log.name][0]) for r in topology.readers]


def reader_status(connection: Any, reader: Reader, last: Position | None, first: Position | None) -> ReaderStatus:
    """``reader``'s position and lag behind ``last`` (the log's last event), read without changing anything. The
    lag counts from ``first`` (the log's first event) when the position is before it: retention removed those
    events unread, and the reader goes on from the first one kept."""
    counts = peek_queue(connection, reader.queue)
    position = peek_position(connection, reader)
    lag = None
    if position is not None:
        since = max(position.offset, first.offset) if first is not None else position.offset
        lag = max(0, last.offset + 1 - since) if last is not None else 0
    return ReaderStatus(reader.name, reader.queue, None if position is None else position.offset,
                        None if position is None else position.generation, lag,
                        None if counts is None else counts.consumers > 0,
                        None if counts is None else counts.messages)


def _status(connection: Any, log: EventLog, api: dict[str, Any] | None, wait_s: float) -> LogStatus:
    counts = peek_queue(connection, log.queue)
    first = last = None
    if counts is not None:
        first, last = position_of(connection, log.queue, wait_s=wait_s)
    segments = api.get("segments") if api else None
    return LogStatus(
        name=log.name, queue=log.queue, binding_keys=list(log.binding_keys),
        max_age=None if log.keep_s is None else max_age(log.keep_s), max_bytes=log.max_bytes,
        segment_bytes=log.segment_bytes, exists=counts is not None,
        messages=None if counts is None else (last.offset - first.offset + 1 if first and last else 0),
        first=first, last=last, consumers=None if counts is None else counts.consumers,
        segments=segments if isinstance(segments, int) else None, management=api is not None)


def position_of(connection: Any, queue: str, *, wait_s: float = 2.0) -> tuple[Position | None, Position | None]:
    """The first and the last message of stream ``queue`` (None, None when it is empty), read without changing it.
    A queue that is gone meanwhile counts as empty."""
    try:
        end = last_chunk_offset(connection, queue, wait_s=wait_s)
        if end is None:
            return None, None
        records = cast("Generator[Any, None, None]", follow(connection, queue, start="first", idle_s=wait_s))
        with closing(records):  # closing it cancels the consumer
            head = next(records, None)
        tail = deque(read(connection, queue, start=end, tail_wait_s=wait_s), maxlen=1)
    except NotFound:
        logger.debug("kombu-events: stream %s is gone", queue)
        return None, None
    if head is None or not tail:
        return None, None
    return _position(*head), _position(*tail[0])


def _position(offset: int, message: Any) -> Position:
    return Position(offset, _iso((message.properties or {}).get("timestamp")))


def _iso(stamp: Any) -> str | None:
    """A ``timestamp`` property (py-amqp gives a naive UTC datetime) as ISO 8601 UTC; None when there is none."""
    if isinstance(stamp, datetime):
        return stamp.replace(tzinfo=timezone.utc).isoformat() if stamp.tzinfo is None else stamp.isoformat()
    if isinstance(stamp, (int, float)) and not isinstance(stamp, bool):
        return datetime.fromtimestamp(stamp, tz=timezone.utc).isoformat()
    return None
