"""``kombu-events log rewind READER --to OFFSET|TIME``: where a rewind goes, how many events it runs again, and the
request, published to the reader's lock queue for the worker that reads (docs/logs.md)."""
from __future__ import annotations

__all__ = ["RewindPlan", "plan_rewind", "target_offset"]

import getpass
import socket
from contextlib import closing
from dataclasses import asdict, dataclass
from datetime import datetime, timedelta, timezone
from typing import Any, Generator, cast

from ..broker.declare import peek_queue
from ..broker.reader_records import peek_position, request_rewind
from ..broker.streams import follow
from ..core.readers import Reader, Rewind
from ..core.topology import Topology
from ..errors import KombuEventsError
from .log_status import position_of

#: A rewind to a time asks the broker for the log from this much earlier, then finds the first event at or after
#: the time by its timestamp property: the broker picks a chunk by its own clock, the publisher stamped its own.
TIME_MARGIN = timedelta(seconds=60)


@dataclass(frozen=True)
class RewindPlan:
    """A rewind of one reader: from its position to ``offset``, and what that runs again."""

    reader: str
    log: str
    offset: int
    #: Where the reader was (the next offset it would read; None: no position written yet).
    position: int | None
    #: The log's last offset (None: empty).
    last: int | None
    #: Events already read that run again (position - offset; 0 when it goes forward).
    again: int
    #: Events from ``offset`` to the log's last, that the reader runs from there.
    to_run: int
    asked: str

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def find_reader(topology: Topology, name: str) -> Reader:
    for reader in topology.readers:
        if reader.name == name:
            return reader
    known = ", ".join(r.name for r in topology.readers) or "none (@events.reader, docs/logs.md)"
    raise KombuEventsError(f"service {topology.settings.service} has no reader {name!r}; its readers: {known}")


def target_offset(connection: Any, reader: Reader, to: str, *, wait_s: float = 2.0) -> int:
    """The offset ``to`` names: a whole number is one; an ISO 8601 time (UTC unless it says) is the offset of the
    first event whose ``timestamp`` property is at or after it (publishers set whole seconds)."""
    if to.isdigit():
        return int(to)
    try:
        when = datetime.fromisoformat(to[:-1] + "+00:00" if to.endswith(("Z", "z")) else to)  # "Z": before 3.11 too
    except ValueError:
        raise KombuEventsError(f"--to {to!r} is neither an offset (a whole number) nor an ISO 8601 time such as "
                               "2026-11-29T10:00:00+00:00") from None
    when = when.replace(tzinfo=timezone.utc) if when.tzinfo is None else when.astimezone(timezone.utc)
    naive = when.replace(tzinfo=None)  # py-amqp's timestamps: naive UTC
    # The broker starts at a chunk by its own clock; a publisher's may differ: ask for a margin earlier, then scan.
    records = cast("Generator[Any, None, None]",
                   follow(connection, reader.log.queue, start=naive - TIME_MARGIN, idle_s=wait_s))
    with closing(records):
        for item in records:
            if item is None:  # nothing more came: the end of the log
                break
            offset, message = item
            stamp = _naive_utc((message.properties or {}).get("timestamp"))
            if stamp is not None and stamp >= naive:
                return int(offset)
    raise KombuEventsError(f"log {reader.log.name!r} holds no event with a timestamp at or after {when.isoformat()}: "
                           "rewind --to an offset (`kombu-events log status` shows the first and the last)")


def _naive_utc(stamp: Any) -> datetime | None:
    """A ``timestamp`` property as a naive UTC datetime (py-amqp gives the property as seconds; a datetime too)."""
    if isinstance(stamp, datetime):
        return stamp.astimezone(timezone.utc).replace(tzinfo=None) if stamp.tzinfo else stamp
    if isinstance(stamp, (int, float)) and not isinstance(stamp, bool):
        return datetime.fromtimestamp(stamp, tz=timezone.utc).replace(tzinfo=None)
    return None


def plan_rewind(connection: Any, topology: Topology, name: str, to: str) -> RewindPlan:
    """What rewinding reader ``name`` to ``to`` does, read without changing anything."""
    reader = find_reader(topology, name)
    if peek_queue(connection, reader.queue) is None:
        raise KombuEventsError(f"the queue {reader.queue} of reader {name!r} is missing: run `kombu-events declare`")
    offset = target_offset(connection, reader, to)
    first, last = position_of(connection, reader.log.queue)
    if first is not None and offset < first.offset:
        raise KombuEventsError(f"offset {offset} is before the first event log {reader.log.name!r} still holds "
                               f"({first.offset}): retention removed what came before it")
    position = peek_position(connection, reader)
    last_offset = None if last is None else last.offset
    again = max(0, position.offset - offset) if position is not None else 0
    to_run = max(0, last_offset - offset + 1) if last_offset is not None else 0
    now = datetime.now(timezone.utc).isoformat(timespec="seconds")
    asked = f"log rewind --to {to} by {getpass.getuser()}@{socket.gethostname()} at {now}"
    return RewindPlan(reader.name, reader.log.name, offset, None if position is None else position.offset,
                      last_offset, again, to_run, asked)


def rewind(connection: Any, topology: Topology, plan: RewindPlan) -> None:
    """Send the rewind request: the worker that reads takes it (or the next one that does)."""
    request_rewind(connection, find_reader(topology, plan.reader), Rewind(plan.offset, plan.asked))
