"""Follows a service's archive stream into the console's index (:mod:`.index`), in a thread of its own.

It reads the stream from its first record, then each record as it is appended, from the offset after the
last one it read; a read changes nothing in the archive (:mod:`kombu_events.broker.streams`). It asks first
for the end of the stream, and the index says "catching up" until it got there. A lost connection (a broker
restart) is connected again, waiting a little longer each time, and the reading goes on from the offset
after the last record read: nothing is read twice, nothing skipped. An archive deleted under it (the broker
cancels the reader: ``kombu-events archive purge --for-good`` makes it again, the same keys at other
offsets) is read again from its start. Every minute it asks where the stream
begins, and forgets the copies retention removed. A missing archive, or one of an earlier version (a
queue, not a stream), is said on every page, and looked at again every few seconds.
"""
from __future__ import annotations

__all__ = ["Follower", "RECOVERABLE"]

import logging
import threading
import time
from contextlib import AbstractContextManager
from typing import Any, Callable

from amqp import exceptions as amqp_errors

from ..broker import streams
from ..core.logs import escape_controls, safe_text
from ..core.topology import Topology
from ..errors import BrokerUnavailableError
from ..ops.archive import parse_record
from .index import ArchiveIndex

logger = logging.getLogger(__name__)

#: What a lost or refused connection raises (py-amqp, sockets, the console's own "cannot reach").
RECOVERABLE = (amqp_errors.ConnectionError, amqp_errors.RecoverableConnectionError, OSError, BrokerUnavailableError)


class Follower:
    """Reads ``topology``'s archive into ``index`` until stopped, over connections from ``connect``."""

    #: Wait before connecting again, times the failures in a row (at most :attr:`max_retry_s`).
    retry_s = 0.5
    max_retry_s = 5.0
    #: Nothing read for this long: the index has all there is (the stream's consumer says so).
    idle_s = 0.5
    #: How often the first offset of the stream is asked for (retention removes the oldest segments).
    retention_check_s = 60.0

    def __init__(self, index: ArchiveIndex, connect: Callable[[], AbstractContextManager[Any]],
                 topology: Topology) -> None:
        self.index, self.connect, self.topology = index, connect, topology
        self.queue = topology.archive_exchange
        self.reconnects = 0
        #: The connection being read (a test closes its socket as a broker restart would).
        self.connection: Any = None
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def start(self) -> None:
        """Start following (once; again after :meth:`stop`)."""
        with self._lock:
            if self._thread is not None and self._thread.is_alive():
                return
            self._stopping.clear()
            self._thread = threading.Thread(target=self._run, name=f"console-index-{self.queue}", daemon=True)
            self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop following (within :attr:`idle_s` or so)."""
        self._stopping.set()
        thread = self._thread
        if thread is not None:
            thread.join(timeout_s)

    def _run(self) -> None:
        failures = 0
        while not self._stopping.is_set():
            try:
                with self.connect() as conn:
                    self.connection = conn
                    failures = 0
                    self._follow(conn)
            except Exception as exc:  # the thread must outlive anything: the pages say what went wrong
                failures += 1
                self._failed(exc)
            finally:
                self.connection = None
            if not self._stopping.is_set():
                self._stopping.wait(min(self.retry_s * failures, self.max_retry_s))

    def _failed(self, exc: BaseException) -> None:
        if isinstance(exc, amqp_errors.ConsumerCancelled):
            self.index.reset()
            why = f"the archive {self.queue!r} was deleted (rewritten?): reading it again from its start"
        elif isinstance(exc, streams.NotAStreamError):
            why = (f"the archive {self.queue!r} is a queue of an earlier kombu-events version, not a stream: the "
                   "console does not read it (a read would change it). Move it to a stream with its messages: "
                   "`kombu-events migrate --archive`")
        elif isinstance(exc, amqp_errors.NotFound):
            why = (f"the archive {self.queue!r} does not exist on the broker: declare the topology "
                   "(`kombu-events declare`, or start a worker)")
        elif isinstance(exc, RECOVERABLE):
            self.reconnects += 1
            why = safe_text(f"connection lost ({type(exc).__name__}: {exc}); reading again from offset "
                            f"{self.index.through + 1}")
        else:
            why = safe_text(f"reading the archive failed ({type(exc).__name__}: {exc}); reading again")
        if why != self.index.error:
            logger.warning("console index of %s: %s", self.queue, escape_controls(why))
        self.index.failed(why)

    def _follow(self, conn: Any) -> None:
        """Read from the offset after the last record read, for as long as nothing stops it."""
        if self.index.end is None and not self.index.caught_up:
            self.index.reached(streams.last_chunk_offset(conn, self.queue))
        start: int | str = self.index.through + 1 if self.index.through >= 0 else "first"
        checked = time.monotonic()
        records = streams.follow(conn, self.queue, start=start, idle_s=self.idle_s)
        try:
            for item in records:
                if self._stopping.is_set():
                    return
                if item is None:
                    self.index.idle()
                else:
                    self.index.apply(parse_record(item[0], item[1], self.index.prefix_bytes))
                if self.index.error:
                    self.index.failed("")
                if time.monotonic() - checked > self.retention_check_s:
                    self._forget_removed(conn)
                    checked = time.monotonic()
        finally:
            records.close()  # type: ignore[attr-defined]  # a generator

    def _forget_removed(self, conn: Any) -> None:
        """Drop from the index the copies before the stream's first offset (removed by retention)."""
        first = streams.follow(conn, self.queue, start="first", idle_s=1.0, prefetch=1)
        try:
            item = next(first)
        finally:
            first.close()  # type: ignore[attr-defined]  # a generator
        if item is not None and self.index.forget_before(item[0]):
            logger.info("console index of %s: copies before offset %d left the stream (retention)", self.queue,
                        item[0])
