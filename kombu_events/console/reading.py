"""How the console reaches the broker: one connection factory, the service's queue status, the index of its
archive (followed in a thread of its own, :mod:`.follower`), one archived copy read at its offset, and the
purge and replay that act on archive keys (the pages, the API and the replay jobs act through
:class:`Service` alone).

No read changes the archive: it is a stream, read by offset. The pages group and search the index, which
holds a body prefix per copy; one event's page reads its copy at its offset (a preview of
:data:`~kombu_events.ops.archive.PREVIEW_BYTES`), and its body is read whole only to be downloaded, at most
:attr:`Service.downloads` at a time. Purge and replay act through :mod:`kombu_events.ops.archive` (the
functions of ``kombu-events archive``), on exactly the archive keys asked for, then wait for their
settlement to be in the index, so that the next page shows it. A copy read at its offset is parsed by the
parser of :func:`kombu_events.ops.archive.records` (:func:`~kombu_events.ops.archive.parse_record`), one
message in flight.
"""
from __future__ import annotations

__all__ = ["Service", "Busy"]

import logging
import threading
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Callable, Collection

from kombu import Connection

from ..broker import streams
from ..broker.connections import connected
from ..core.logs import safe_text, safe_url
from ..errors import BrokerUnavailableError, KombuEventsError
from ..ops.archive import ArchivedMessage, parse_record, purge, replay
from ..ops.status import QueueStatus, gather
from ..registry import EventsService
from . import query
from .entries import Entry
from .follower import Follower
from .index import ArchiveIndex, IndexView

logger = logging.getLogger(__name__)


class Busy(KombuEventsError):
    """As many whole bodies as the console reads at once are being read: try again in a moment."""


class Service:
    """One Events service as the console sees it: its topology, its broker, the index of its archive."""

    #: Whole bodies read at once (each one a download being served); one more is refused, not queued.
    downloads = 2
    #: How long an action waits for its settlement to be folded into the index.
    settle_wait_s = 5.0
    #: How long one copy's read at its offset waits for it (it is in the stream: it comes at once).
    read_wait_s = 5.0
    #: How long a look-up of a copy the index has not read (yet) waits for the index to catch up.
    catch_up_wait_s = 3.0

    def __init__(self, events: EventsService, *, broker_url: str | None = None,
                 management_url: str | None = None) -> None:
        self.events = events
        self.url = broker_url or events.broker_url
        self.topology = events.topology()
        self.management_url = management_url
        self.index = ArchiveIndex()
        self.follower = Follower(self.index, self.connection, self.topology)
        self._downloads = threading.BoundedSemaphore(self.downloads)
        #: Held by a page's or the API's search: one runs at a time (each within its time budget), so that
        #: searches never take the interpreter from the event loop's thread more than one thread's share.
        self.searching = threading.Lock()
        self._status_lock = threading.Lock()
        self._status: list[QueueStatus] | None = None

    @property
    def name(self) -> str:
        """The service's name."""
        return self.events.service

    @property
    def shown_url(self) -> str:
        """The broker URL with its password masked: the only form the console ever shows."""
        return safe_url(self.url)

    def connection(self) -> AbstractContextManager[Connection]:
        """A connected connection with the app's broker settings (TLS included); unreachable: one clear error."""
        return connected(self.url, self.events.app)

    def start(self) -> None:
        """Start following the archive into the index (done by the first page that needs it, or at startup)."""
        self.follower.start()

    def stop(self) -> None:
        """Stop following the archive."""
        self.follower.stop()

    def view(self) -> IndexView:
        """The archive as indexed now (see :class:`.index.IndexView`)."""
        self.start()
        return self.index.view()

    def entry(self, key: str) -> Entry | None:
        """The index's entry of the copy ``key``, if it is still archived (while the index catches up, once it
        has, or :attr:`catch_up_wait_s` at most)."""
        self.start()
        found = self.index.get(key)
        if found is None and self.index.settlement(key) is None and self.index.wait_caught_up(self.catch_up_wait_s):
            found = self.index.get(key)
        return found

    def with_id(self, message_id: str) -> list[Entry]:
        """The copies still archived with this message id (the index caught up first, as for :meth:`entry`)."""
        self.start()
        self.index.wait_caught_up(self.catch_up_wait_s)
        return self.index.with_id(message_id)

    def status(self) -> list[QueueStatus]:
        """Counts of every queue of the service (passive declares; unacked from the management API), the
        archive's count from the index once it has caught up. One read at a time: while one runs, a caller
        gets the last counts read."""
        if not self._status_lock.acquire(blocking=self._status is None):
            assert self._status is not None
            return self._status
        try:
            view = self.index.view()
            known = len(view.entries) if view.caught_up and not view.error else None
            with self.connection() as conn:  # the index's count: the stream is not read again for it
                rows = gather(conn, self.topology, self.management_url, archived=known)
            self._status = rows
            return rows
        finally:
            self._status_lock.release()

    def read(self, entry: Entry, *, body_limit: int | None) -> ArchivedMessage | None:
        """The copy of ``entry`` read at its offset (``body_limit``: its body's first bytes; None: whole, at
        most :attr:`downloads` at a time, else :class:`Busy`); None when retention removed it."""
        if body_limit is not None:
            return self._read(entry, body_limit)
        if not self._downloads.acquire(blocking=False):
            raise Busy(f"{self.downloads} whole bodies are being read already: try again in a moment")
        try:
            return self._read(entry, None)
        finally:
            self._downloads.release()

    def _read(self, entry: Entry, body_limit: int | None) -> ArchivedMessage | None:
        with self.connection() as conn:
            # one message in flight: the copies after it may be large, and none of them is wanted
            records = streams.follow(conn, self.topology.archive_exchange, start=entry.offset,
                                     idle_s=self.read_wait_s, prefetch=1)
            try:
                for item in records:
                    if item is None or item[0] > entry.offset:
                        return None
                    if item[0] == entry.offset:
                        found = parse_record(item[0], item[1], body_limit)
                        return found if isinstance(found, ArchivedMessage) and found.key == entry.key else None
            finally:
                records.close()  # type: ignore[attr-defined]  # a generator
        return None

    def purge(self, keys: Collection[str], *, by: str, note: str = "") -> list[ArchivedMessage]:
        """Settle as purged the copies of ``keys`` still archived (:func:`kombu_events.ops.archive.purge`);
        those it purged, once the index shows it."""
        wanted = set(keys)
        with self.connection() as conn:
            purged = purge(conn, self.topology, lambda m: m.key in wanted, by=by, note=note,
                           start=self.first_offset(wanted))
        self.index.wait_settled([m.key for m in purged], self.settle_wait_s)
        return purged

    def search_turn(self, text: str) -> AbstractContextManager[Any]:
        """Held while the search ``text`` runs: searches take turns (one CPU-bound thread at a time beside the
        event loop's); no search (an empty ``text``: the first page of the index) waits for none."""
        return nullcontext() if query.parse(text).empty else self.searching

    def first_offset(self, keys: Collection[str]) -> int | str:
        """The smallest offset of the indexed copies of ``keys`` (where a purge or a replay of them reads from),
        or ``"first"`` when the index knows none of them."""
        offsets = [entry.offset for entry in (self.index.get(key) for key in keys) if entry is not None]
        return min(offsets) if offsets else "first"

    def replay(self, match: Callable[[ArchivedMessage], bool], limit: int | None = None, **options: Any
               ) -> tuple[list[ArchivedMessage], list[tuple[ArchivedMessage, str]]]:
        """Replay the archived copies that ``match`` on a connection of its own:
        :func:`kombu_events.ops.archive.replay` and its keyword ``options``; (replayed, [(kept, why)]),
        once the index shows them replayed. A lost connection raises, as ``replay`` does (a job connects again),
        a BrokerUnavailableError when ``replay`` said only that its confirms never came.
        """
        with self.connection() as conn:
            try:
                replayed, kept = replay(conn, self.topology, match, limit, **options)
            except KombuEventsError as exc:
                if conn.connected:
                    raise
                raise BrokerUnavailableError(safe_text(f"the connection was lost during a replay: {exc}")) from exc
        self.index.wait_settled([m.key for m in replayed], self.settle_wait_s)
        return replayed, kept
