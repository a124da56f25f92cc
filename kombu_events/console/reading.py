"""How the console reaches the broker: one connection factory, the service's queue status, a
short-lived snapshot of the archive that every page of a browsing session shares, and the purge and
replay that act on it (the pages, the API and the replay jobs act through :class:`Service` alone).

The archive is read by :func:`kombu_events.ops.archive.browse`: a consumer that never acks, then
the channel closes and every message goes back in its place, in the same order, none removed
(see docs/console.md for what an operator sees meanwhile). A read of 10,000 messages still takes
a second or more, so the pages group and search one snapshot, taken at
most ``max_age_s`` ago (a "Read again" link takes a new one); actions never act on the snapshot
alone: they read the archive again and take only the ids the operator saw.
"""
from __future__ import annotations

__all__ = ["Service", "Snapshot"]

import logging
import threading
import time
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Callable

from kombu import Connection

from ..broker.connections import connected
from ..core.logs import safe_url
from ..ops.archive import ArchivedMessage, browse, purge, replay
from ..ops.status import QueueStatus, gather

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Snapshot:
    """The archive's messages as read at ``taken_at`` (epoch seconds), in archive order, and how long it took."""

    messages: tuple[ArchivedMessage, ...]
    taken_at: float
    read_s: float

    def by_id(self, message_id: str) -> ArchivedMessage | None:
        """The message with this id in the snapshot, or None."""
        return next((m for m in self.messages if m.id == message_id), None)


class Service:
    """One Events service as the console sees it: its topology, its broker, its archive snapshot."""

    def __init__(self, events: Any, *, broker_url: str | None = None, max_age_s: float = 10.0,
                 management_url: str | None = None) -> None:
        self.events = events
        self.url = broker_url or str(events.broker_url)
        self.topology = events.topology()
        self.max_age_s = max_age_s
        self.management_url = management_url
        self._lock = threading.Lock()
        self._snapshot: Snapshot | None = None

    @property
    def name(self) -> str:
        """The service's name."""
        return str(self.events.service)

    @property
    def shown_url(self) -> str:
        """The broker URL with its password masked: the only form the console ever shows."""
        return safe_url(self.url)

    def connection(self) -> AbstractContextManager[Connection]:
        """A connected connection with the app's broker settings (TLS included); unreachable: one clear error."""
        return connected(self.url, getattr(self.events, "app", None))

    def status(self) -> list[QueueStatus]:
        """Counts of every queue of the service (passive declares; unacked from the management API)."""
        with self.connection() as conn:
            return gather(conn, self.topology, self.management_url)

    def snapshot(self, *, fresh: bool = False) -> Snapshot:
        """The archive as read at most ``max_age_s`` ago (``fresh``: read it now)."""
        with self._lock:
            current = self._snapshot
            if fresh or current is None or time.time() - current.taken_at > self.max_age_s:
                started = time.monotonic()
                with self.connection() as conn:
                    messages = browse(conn, self.topology)
                current = Snapshot(tuple(messages), time.time(), time.monotonic() - started)
                self._snapshot = current
                logger.debug("archive of %s read: %d message(s) in %.2f s", self.name, len(messages),
                             current.read_s)
            return current

    def forget(self) -> None:
        """Drop the snapshot: the next page reads the archive again (after a replay or a purge)."""
        with self._lock:
            self._snapshot = None

    def purge(self, ids: set[str]) -> list[ArchivedMessage]:
        """Delete the archived messages with these ids (those still there); forget the snapshot; what went."""
        with self.connection() as conn:
            removed = purge(conn, self.topology, lambda m: m.id in ids)
        self.forget()
        return removed

    def replay(self, match: Callable[[ArchivedMessage], bool], limit: int | None = None, **options: Any
               ) -> tuple[list[ArchivedMessage], list[tuple[ArchivedMessage, str]]]:
        """Replay the archived messages that ``match`` on a connection of its own:
        :func:`kombu_events.ops.archive.replay` and its keyword ``options``; (replayed, [(kept, why)]).

        A lost connection raises, as ``replay`` does (a replay job connects again); the snapshot is
        forgotten either way.
        """
        try:
            with self.connection() as conn:
                return replay(conn, self.topology, match, limit, **options)
        finally:
            self.forget()
