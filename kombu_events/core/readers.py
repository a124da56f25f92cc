"""A reader of a log of events (``@events.reader(log)``): its queues, where it starts, and the records it keeps
on the broker, its position and a rewind request (docs/logs.md). Pure: no I/O.

A reader reads its log's stream in order, one event in flight, in the worker's pool. Two queues of the
service hold what it needs, both classic (a classic queue never counts a delivery, so reading them changes
nothing on RabbitMQ 4 either, whatever the service's ``queue_type``):

- ``<service>.reader.<name>``: the fleet's lock and the reader's mailbox. The worker that reads holds the
  queue's only *exclusive* consumer; the others' consumers are refused, so they wait and try again. An
  operator's ``log rewind`` is a message in it, delivered to that worker (or, with none, to the next one).
- ``<service>.reader.<name>.position``: the position, one message (``x-max-length`` 1: a new one drops the
  old), written by the reader's worker every :data:`COMMIT_EVERY` events or :data:`COMMIT_MS`, and when it
  stops, and read when a worker takes the lock.
"""
from __future__ import annotations

__all__ = ["Reader", "Position", "Rewind", "reader", "reader_queues", "check_unique", "stream_offset", "reader_key",
           "COMMIT_EVERY", "COMMIT_MS", "POSITION_HEADER", "REWIND_HEADER", "GENERATION_HEADER", "OFFSET_HEADER"]

import json
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Iterable, Union

from kombu import Queue

from ..errors import ConfigurationError
from . import names
from .event_log import EventLog

#: A reader's position is written after this many events handled since the last write...
COMMIT_EVERY = 100
#: ...or this long after the first of them, whichever comes first (and when the worker stops).
COMMIT_MS = 1000
#: Headers that mark a position record and a rewind request (anything else in the queues is ignored).
POSITION_HEADER = "x-kombu-events-reader-position"
REWIND_HEADER = "x-kombu-events-reader-rewind"
#: The stream's offset of an event (the broker sets it), and the reader's generation (its worker sets it).
OFFSET_HEADER = "x-stream-offset"
GENERATION_HEADER = "x-kombu-events-reader-generation"

Start = Union[str, int, datetime]


@dataclass(frozen=True)
class Reader:
    """One reader of a log: its name, the log, where it starts when it has no position yet, and its queues."""

    name: str
    log: EventLog
    #: ``"first"``, ``"last"``, ``"next"``, an offset (int >= 0) or an aware datetime.
    start: Start
    #: ``<service>.reader.<name>``: its lock (an exclusive consumer) and its rewind requests.
    queue: str
    #: ``<service>.reader.<name>.position``: its position, one message.
    position_queue: str


@dataclass(frozen=True)
class Position:
    """Where a reader goes on: ``offset`` is the next offset to read; ``generation`` counts its rewinds."""

    offset: int
    generation: int = 0

    def body(self, *, reader: str, stream: str) -> bytes:
        return json.dumps({"reader": reader, "stream": stream, "offset": self.offset,
                           "generation": self.generation}).encode()

    @classmethod
    def parse(cls, body: Any) -> Position:
        """A position from its JSON body; ValueError if it is not one."""
        data = _json_object(body, "reader position")
        offset, generation = data.get("offset"), data.get("generation", 0)
        if not _natural(offset) or not _natural(generation):
            raise ValueError(f"not a reader position (offset and generation must be whole numbers >= 0): {data!r}")
        return cls(int(offset), int(generation))  # type: ignore[arg-type]  # checked by _natural


@dataclass(frozen=True)
class Rewind:
    """An operator's request: go on from ``offset`` (resolved by ``log rewind`` from an offset or a time)."""

    offset: int
    #: Who asked, when, and what they gave (for the worker's log line and the audit).
    asked: str = ""

    def body(self) -> bytes:
        return json.dumps({"offset": self.offset, "asked": self.asked}).encode()

    @classmethod
    def parse(cls, body: Any) -> Rewind:
        """A rewind from its JSON body; ValueError if it is not one."""
        data = _json_object(body, "rewind request")
        if not _natural(data.get("offset")):
            raise ValueError(f"not a rewind request (offset must be a whole number >= 0): {data!r}")
        return cls(data["offset"], str(data.get("asked") or ""))


def reader(service: str, log: Any, *, name: Any, start: Any) -> Reader:
    """What ``@events.reader(...)`` was given, checked: a ConfigurationError names the bad value and what fits."""
    if not isinstance(log, EventLog):
        raise ConfigurationError(f"reader() reads a log: pass what events.log(...) returned, got {log!r}")
    queue = names.validate_name("name of a reader", f"{service}.reader.{names.validate_name('reader name', name)}")
    return Reader(name, log, check_start(start), queue, names.validate_name("reader queue", f"{queue}.position"))


def check_start(start: Any) -> Start:
    """``start`` if a reader can start there, else ConfigurationError."""
    if start in ("first", "last", "next"):
        return str(start)
    if isinstance(start, datetime):
        if start.tzinfo is None:
            raise ConfigurationError(f"start= of a reader must be an aware datetime (with tzinfo), got {start!r}")
        return start
    if _natural(start):
        return int(start)
    raise ConfigurationError(f"start= of a reader must be 'first', 'last', 'next', an offset (a whole number >= 0) "
                             f"or an aware datetime, got {start!r}")


def stream_offset(start: Start) -> Any:
    """The ``x-stream-offset`` consumer argument for ``start`` (a datetime goes as an AMQP timestamp, UTC)."""
    if isinstance(start, datetime):
        return start.astimezone(timezone.utc).replace(tzinfo=None)
    return start


def reader_key(event: Any) -> str:
    """The inbox key of an event a ``once=True`` reader reads: its offset in the log and the reader's generation
    (``offset@generation``), so that an event read again after a crash is dropped and one a rewind runs again is
    not."""
    headers = event.headers or {}
    return f"{int(headers[OFFSET_HEADER])}@{int(headers.get(GENERATION_HEADER, 0))}"


def check_unique(new: Reader, others: Iterable[Reader]) -> None:
    """ConfigurationError if another reader of the service has ``new``'s name."""
    for other in others:
        if other.name == new.name:
            raise ConfigurationError(f"two readers are named {new.name!r} (of logs {other.log.name!r} and "
                                     f"{new.log.name!r}): give one of them name=")


def reader_queues(readers: Iterable[Reader]) -> list[Queue]:
    """Each reader's two classic queues: its lock and mailbox, and its position (one message)."""
    found = []
    for r in readers:
        found.append(Queue(r.queue, durable=True, queue_arguments={"x-queue-type": "classic"}))
        found.append(Queue(r.position_queue, durable=True,
                           queue_arguments={"x-queue-type": "classic", "x-max-length": 1, "x-overflow": "drop-head"}))
    return found


def _natural(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _json_object(body: Any, what: str) -> dict[str, Any]:
    try:
        data = json.loads(bytes(body) if isinstance(body, (bytes, bytearray, memoryview)) else str(body))
    except (TypeError, ValueError) as exc:
        raise ValueError(f"not a {what}: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"not a {what}: {data!r}")
    return data
