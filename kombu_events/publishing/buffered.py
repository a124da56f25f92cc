"""Publishing with a backlog: to the broker while it answers, into the backlog while not; drained in order.

:class:`BacklogPublisher` carries out what :mod:`kombu_events.publishing.backlog_policy` and
:mod:`kombu_events.publishing.breakers` decide. Its daemon thread (one per process,
started when events wait or checks are due) runs the health checks and flushes the
backlog batch by batch, each under the backlog's flush lock: read the oldest rows,
publish them with pipelined confirms, delete the confirmed ones. A crash between the
confirm and the delete publishes those rows again: duplicates, at most one batch, never
a loss.
"""
from __future__ import annotations

__all__ = ["BacklogPublisher", "FlushReport", "STORED"]

import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from amqp import Message

from ..core.health import run_check
from ..errors import KombuEventsError, UnroutableError
from .backlog import Backlog, Stored, encode_properties
from .backlog_policy import PUBLISH, publish_or_store, settle_batch, storable
from .breakers import Change, PublisherBreakers
from .publisher import Publisher

logger = logging.getLogger(__name__)

#: What :meth:`BacklogPublisher.publish_or_store` returns for an event it stored in the backlog.
STORED = "stored"

Item = tuple[str, str, Message]
#: ``(exchange, routing_key, properties, error)`` for each flushed event the broker settled.
OnFlushed = Callable[[str, str, dict[str, Any], "Exception | None"], None]


@dataclass
class FlushReport:
    """What one flush did."""

    published: int = 0
    rejected: int = 0
    error: Exception | None = None
    busy: bool = False  # another flusher holds the lock


class BacklogPublisher:
    """The backlog, the circuits and the flusher of one :class:`~kombu_events.Events`."""

    def __init__(self, backlog: Backlog, publisher: Callable[[], Publisher], breakers: PublisherBreakers, *,
                 on_flushed: OnFlushed | None = None, clock: Callable[[], float] = time.monotonic,
                 idle_poll_s: float = 1.0) -> None:
        self.backlog, self.breakers, self.clock = backlog, breakers, clock
        self._publisher, self._on_flushed, self.idle_poll_s = publisher, on_flushed, idle_poll_s
        self._lock = threading.RLock()  # the breakers' state; starting and ending the thread
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._pid = os.getpid()

    # -- publishing ------------------------------------------------------------------------------

    def publish_or_store(self, items: Sequence[Item]) -> list[Exception | str | None]:
        """Per item: None (confirmed), :data:`STORED`, or the error the caller must see."""
        for _x, _k, message in items:
            encode_properties(message.properties)  # the same EncodeError whether the broker is up or not
        if self._pid != os.getpid() or (self._thread is None and self.breakers.periodic()):
            self._start_if_wanted()
        with self._lock:
            closed = self.breakers.closed()
        if publish_or_store(circuit_closed=closed, backlog_pending=closed and self.backlog.pending()) != PUBLISH:
            return self._store(items)
        try:
            results: list[Exception | str | None] = list(self._publisher().send_many(items))
        except KombuEventsError as exc:
            results = [exc] * len(items)
        failed = {i: e for i, e in enumerate(results) if isinstance(e, Exception) and storable(e)}
        if failed:
            self._failed(next(iter(failed.values())))
            for i, outcome in zip(failed, self._store([items[i] for i in failed])):
                results[i] = outcome
        return results

    def _store(self, items: Sequence[Item]) -> list[Exception | str | None]:
        try:
            self.backlog.store(items)
        except KombuEventsError as exc:
            return [exc] * len(items)
        self.start()
        return [STORED] * len(items)

    def _failed(self, error: Exception, now: float | None = None) -> None:
        with self._lock:
            change = self.breakers.publish_failed(self.clock() if now is None else now, str(error))
        _log_change(change)

    # -- flushing --------------------------------------------------------------------------------

    def flush_once(self, publisher: Publisher | None = None) -> FlushReport:
        """Publish the oldest batch under the flush lock; delete what the broker confirmed."""
        with self.backlog.flush_lock() as held:
            if not held:
                return FlushReport(busy=True)
            rows = self.backlog.head()
            if not rows:
                return FlushReport()
            return self._flush_rows(rows, publisher or self._publisher())

    def _flush_rows(self, rows: Sequence[Stored], publisher: Publisher) -> FlushReport:
        items = [(r.exchange, r.routing_key, r.message()) for r in rows]
        try:
            results: list[Exception | None] = list(publisher.send_many(items))
        except KombuEventsError as exc:
            results = [exc] * len(items)
        batch = settle_batch([r.seq for r in rows], results)
        self.backlog.settle(batch.confirmed, batch.rejected)
        for seq, why in batch.rejected:
            logger.error("kombu-events: backlog event #%s set aside, the broker cannot route it: %s", seq, why)
        self._report_flushed(rows, results)
        return FlushReport(len(batch.confirmed), len(batch.rejected), batch.error)

    def _report_flushed(self, rows: Sequence[Stored], results: Sequence[Exception | None]) -> None:
        if self._on_flushed is None:
            return
        for row, error in zip(rows, results):  # final outcomes only: a row kept for later is reported then
            if error is None or isinstance(error, UnroutableError):
                self._on_flushed(row.exchange, row.routing_key, row.properties, error)

    def flush(self, publisher: Publisher | None = None, *, timeout_s: float | None = None) -> FlushReport:
        """Flush until the backlog is empty, a batch fails, or ``timeout_s`` passes (the CLI's flush)."""
        total = FlushReport()
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            report = self.flush_once(publisher)
            total.published += report.published
            total.rejected += report.rejected
            total.error, total.busy = report.error, report.busy
            if report.error or (not report.busy and not report.published and not report.rejected):
                return total
            if deadline is not None and time.monotonic() > deadline:
                return total
            if report.busy:
                time.sleep(0.2)

    # -- the daemon thread -----------------------------------------------------------------------

    def start(self) -> None:
        """Make sure this process's daemon thread runs (after a fork, the child starts its own)."""
        with self._lock:
            if self._pid != os.getpid():
                self._pid, self._thread, self._wake = os.getpid(), None, threading.Event()
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="kombu-events-backlog", daemon=True)
                self._thread.start()
            self._wake.set()

    def _start_if_wanted(self) -> None:
        with self._lock:
            if self._pid != os.getpid():  # the parent's thread did not come through the fork
                self._pid, self._thread, self._wake = os.getpid(), None, threading.Event()
        if self.wanted():
            self.start()

    def wanted(self) -> bool:
        """Whether the daemon has work: events wait, a circuit is open, or a check runs on an interval."""
        with self._lock:
            return not self.breakers.closed() or self.breakers.periodic() or self.backlog.pending()

    def _run(self) -> None:
        me = threading.current_thread()
        while self._thread is me:  # stop() or a fork ends this loop
            try:
                wait = self._step()
                if wait is None:
                    if self._ended(me):
                        return
                    wait = 0.0
            except Exception:  # never let the thread die with events waiting: log, wait, retry
                logger.exception("kombu-events: the backlog flusher of %s failed; retrying in %s s",
                                 self.backlog.path, self.idle_poll_s)
                wait = self.idle_poll_s
            self._wake.wait(wait)
            self._wake.clear()

    def _ended(self, me: threading.Thread) -> bool:
        """Whether the thread ends: no work is left (decided under the lock start() takes: no event is left behind)."""
        with self._lock:
            if self.wanted():
                return False
            if self._thread is me:
                self._thread = None
            return True

    def _step(self) -> float | None:
        """Run due checks, flush one batch if the circuits allow; how long to wait (None: nothing to do)."""
        self._run_checks()
        with self._lock:
            closed = self.breakers.closed()
        if closed and self.backlog.pending():
            report = self.flush_once()
            if report.error is not None:
                if not storable(report.error):
                    logger.error("kombu-events: flushing the backlog failed: %s", report.error)
                self._failed(report.error)  # the circuit says when to try again
            return self.idle_poll_s if report.busy else 0.0
        with self._lock:
            now = self.clock()
            due = self.breakers.next_due(now)
        if due is not None:
            return min(max(0.0, due - now), self.idle_poll_s * 5)
        return None if not self.wanted() else self.idle_poll_s

    def _run_checks(self) -> None:
        with self._lock:
            due = self.breakers.due(self.clock())
        for check in due:
            result = run_check(check.fn)
            with self._lock:
                change = self.breakers.report(check.name, result.status, self.clock(), result.reason)
            _log_change(change)

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop the daemon thread (tests, shutdown); events stay in the backlog."""
        thread = self._thread
        self._thread = None
        self._wake.set()
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout_s)


def _log_change(change: Change | None) -> None:
    """A circuit that closes is news (INFO); one that opens is a warning, an error when trips come often."""
    if change is None:
        return
    level = logging.WARNING
    if change.state == "closed":
        level = logging.INFO
    elif change.state == "open" and change.level == "error":
        level = logging.ERROR
    logger.log(level, "kombu-events: publisher circuit %r %s -> %s%s", change.check, change.previous,
               change.state, f" ({change.reason})" if change.reason else "")
