"""Counting the archive: the copies still archived (neither replayed nor purged), read incrementally.

The metrics' gauges and ``kombu-events status`` count with it; it reads only what was appended since
its last count, and a read changes nothing in the archive.
"""
from __future__ import annotations

__all__ = ["ArchiveCounter", "archived_count"]

import logging
from collections import deque
from typing import Any

from amqp.exceptions import NotFound

from ..broker import streams
from ..core.archive_records import Fold, Settlement
from ..core.topology import Topology
from .archive_read import ArchivedMessage, records

logger = logging.getLogger(__name__)


class ArchiveCounter:
    """How many copies the archive holds (pending: neither replayed nor purged), counted incrementally: each
    :meth:`count` reads only the records appended since the last one, and forgets copies that retention removed
    (those before the stream's first offset). Holds one key and offset per copy, no body; ``bytes`` is the size
    of every record still in the stream (bodies and headers as stored: about what retention by bytes counts)."""

    def __init__(self, topology: Topology) -> None:
        self.topology = topology
        self._reset()

    def _reset(self) -> None:
        self.fold: Fold[int] = Fold()
        self.next_offset = 0
        self.bytes = 0
        self._sizes: deque[tuple[int, int]] = deque()  # (offset, bytes) of every record read, in order
        self._last: tuple[str, ...] | None = None  # what the last record read was (see _identity)

    def count(self, connection: Any) -> int:
        """The copies archived now (see the class)."""
        queue = self.topology.archive_exchange
        first = _first_offset(connection, queue)
        if first is not None and first > self.next_offset:
            self.next_offset = first  # retention removed what was not read yet
        start = self.next_offset
        again = start - 1 if self._last is not None else None  # the last record read: is it still there?
        for record in records(connection, self.topology, start=start if again is None else again, body_limit=0,
                              full=False):
            if again is not None:
                if record.offset < again:
                    continue  # a read from an offset begins with that offset's chunk
                if record.offset != again or _identity(record) != self._last:
                    self._reset()  # the stream was made again (a rewrite): same keys, other offsets
                    return self.count(connection)
                again = None
                continue
            self.next_offset = max(self.next_offset, record.offset + 1)
            if record.offset < start:
                continue  # read again from the start of a chunk
            self._last = _identity(record)
            if isinstance(record, Settlement):
                self.fold.settle(record)
                size = record.size
            else:
                self.fold.add(record.key, record.offset)
                size = record.size + record.stored_header_bytes
            self._sizes.append((record.offset, size))
            self.bytes += size
        if again is not None:  # the last record read is not there any more: the stream was made again
            self._reset()
            return self.count(connection)
        while self._sizes and first is not None and self._sizes[0][0] < first:
            self.bytes -= self._sizes.popleft()[1]
        if first is not None:  # retention removed them: forget them (settlements older than a copy are too)
            for key in [k for k, offset in self.fold.copies.items() if offset < first]:
                del self.fold.copies[key]
            for key in [k for k, settlement in self.fold.settled.items() if settlement.offset < first]:
                del self.fold.settled[key]
        return len(self.fold.copies)


def _identity(record: ArchivedMessage | Settlement) -> tuple[str, ...]:
    """What tells a record apart once offsets may have changed: a copy's key, a settlement's action, time, keys."""
    if isinstance(record, Settlement):
        return (record.action, record.at, *record.keys)
    return (record.key,)


def _first_offset(connection: Any, queue: str) -> int | None:
    """The offset of the first record still in stream ``queue`` (None: empty)."""
    try:
        for offset, _ in streams.read(connection, queue, start="first", settle_s=0.0):
            return offset
    except (NotFound, streams.NotAStreamError):
        return None  # records() says why, with the words for it
    return None


def archived_count(connection: Any, topology: Topology) -> int:
    """Copies in the archive now (pending), read from the whole stream (body bytes not kept)."""
    return ArchiveCounter(topology).count(connection)
