"""The console's index of one service's archive: every record read so far folded in (copies by archive key,
settlements applied), shared by every page. No I/O: :mod:`.follower` feeds it from the archive stream.

Pages read an :class:`IndexView`, an immutable snapshot taken under the lock (made again only when a record
changed something), so that a search or a grouping never holds the lock. The index says whether it has caught
up, that is read the archive up to the end it found when it began: until then pages say that what they show
is partial. Actions wait here for their settlements to be folded in (:meth:`ArchiveIndex.wait_settled`), so
that the page after a purge or a replay shows it.
"""
from __future__ import annotations

__all__ = ["ArchiveIndex", "IndexView"]

import threading
import time
from dataclasses import dataclass
from typing import Iterable

from ..core.archive_records import Fold, Settlement
from ..ops.archive import ArchivedMessage
from .entries import BODY_PREFIX_BYTES, Entry, entry_of


@dataclass(frozen=True)
class IndexView:
    """The archive as indexed when the view was taken: the copies still archived, in stream order."""

    entries: tuple[Entry, ...]
    #: The offset of the last record read (-1: none yet); every copy at or before it is in ``entries``
    #: unless settled (the selection of an action is "matching, at or before this offset").
    through: int
    caught_up: bool
    #: Records read so far (copies and settlements), and the end the index is catching up to.
    records: int
    end: int | None
    error: str


class ArchiveIndex:
    """The copies of an archive still archived, folded from its records as they are read (thread-safe)."""

    def __init__(self, *, prefix_bytes: int = BODY_PREFIX_BYTES) -> None:
        self.prefix_bytes = prefix_bytes
        self._changed = threading.Condition()
        self.error = ""
        self.reset()

    def reset(self) -> None:
        """Forget everything read: the stream is read again from its start (it was deleted and made again, as
        ``kombu-events archive purge --for-good`` does: the same keys, other offsets)."""
        with self._changed:
            self._fold: Fold[Entry] = Fold()
            self.through = -1
            self.records = 0
            self.end: int | None = None
            self.caught_up = False
            self._touched()

    def apply(self, record: ArchivedMessage | Settlement) -> None:
        """Fold in one record read from the stream, in stream order (one read again is ignored)."""
        with self._changed:
            if record.offset <= self.through:
                return
            if isinstance(record, Settlement):
                self._fold.settle(record)
                for key in record.keys:  # the settlement is kept; the copy's entry is not needed any more
                    self._fold.copies.pop(key, None)
            elif record.key not in self._fold.settled:  # a copy written again (a migration): the first counts
                self._fold.add(record.key, entry_of(record, prefix_bytes=self.prefix_bytes))
            self.through, self.records = record.offset, self.records + 1
            if self.end is not None and record.offset >= self.end:
                self.caught_up = True
            self._touched()

    def reached(self, end: int | None) -> None:
        """The stream's end as found when the index began reading (None: an empty stream)."""
        with self._changed:
            self.end = end
            if end is None or self.through >= end:
                self.caught_up = True
            self._touched()

    def idle(self) -> None:
        """Nothing more came for a while: past the end found at the start, the index has caught up."""
        with self._changed:
            if not self.caught_up and (self.end is None or self.through >= self.end):
                self.caught_up = True
                self._touched()

    def failed(self, error: str) -> None:
        """Why the index cannot read the archive now (empty: it reads again)."""
        with self._changed:
            if error != self.error:
                self.error = error
                self._touched()

    def forget_before(self, first: int) -> int:
        """Drop the copies retention removed from the stream (before offset ``first``); how many."""
        with self._changed:
            gone = [key for key, entry in self._fold.copies.items() if entry.offset < first]
            for key in gone:
                del self._fold.copies[key]
            if gone:
                self._touched()
            return len(gone)

    def _touched(self) -> None:
        self._view: IndexView | None = None
        self._changed.notify_all()

    def view(self) -> IndexView:
        """The index now (the same object until a record changes it)."""
        with self._changed:
            if self._view is None:
                self._view = IndexView(tuple(self._fold.pending()), self.through, self.caught_up, self.records,
                                       self.end, self.error)
            return self._view

    def get(self, key: str) -> Entry | None:
        """The copy ``key`` if it is still archived."""
        with self._changed:
            return self._fold.copies.get(key) if self._fold.is_pending(key) else None

    def settlement(self, key: str) -> Settlement | None:
        """How the copy ``key`` was settled (replayed, purged), if it was."""
        with self._changed:
            return self._fold.settled.get(key)

    def with_id(self, message_id: str) -> list[Entry]:
        """The copies still archived whose message id is ``message_id`` (several copies may share one)."""
        return [e for e in self.view().entries if e.id == message_id]

    def wait_settled(self, keys: Iterable[str], timeout_s: float) -> bool:
        """Wait until every copy of ``keys`` is settled here (at most ``timeout_s``); whether they all are."""
        wanted = set(keys)
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while not wanted <= self._fold.settled.keys():
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._changed.wait(left)
            return True

    def wait_caught_up(self, timeout_s: float) -> bool:
        """Wait until the index has caught up (at most ``timeout_s``); whether it has."""
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while not self.caught_up:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._changed.wait(left)
            return True
