"""The local backlog: events waiting for the broker, in one SQLite file several processes share.

One row per event: the exact body bytes as published, the properties as JSON (never
pickled), and an AUTOINCREMENT sequence number that orders them. The database runs in
WAL mode with ``synchronous=FULL`` (a stored event survives a crash of the process and
of the machine) and a busy timeout (writers from several processes wait their turn).
One flusher at a time holds an ``flock`` on ``<path>.lock``; the kernel releases it
when its process dies, even by ``kill -9``.
"""
from __future__ import annotations

__all__ = ["Backlog", "open_backlog", "Stored", "BacklogStatus", "encode_properties", "decode_properties",
           "DEFAULT_MAX_BYTES"]

import json
import logging
import os
import sqlite3
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator, Mapping, Sequence

from amqp import Message

from ..errors import BacklogError, BacklogFullError, ConfigurationError, EncodeError

logger = logging.getLogger(__name__)

DEFAULT_MAX_BYTES = 256 * 1024 * 1024

#: Connections a forked child inherited. Closing one in the child would drop the child's own POSIX
#: locks on the file (they are per process and per file), so they are kept, unused, until exit.
_INHERITED: list[sqlite3.Connection] = []

_SCHEMA = """
CREATE TABLE IF NOT EXISTS events (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    stored_at REAL NOT NULL,
    exchange TEXT NOT NULL,
    routing_key TEXT NOT NULL,
    message_id TEXT,
    properties TEXT NOT NULL,
    body BLOB NOT NULL,
    rejected TEXT
);
CREATE INDEX IF NOT EXISTS events_pending ON events (rejected, seq);
"""


def encode_properties(properties: Mapping[str, Any]) -> str:
    """The message properties as JSON; headers must be JSON values (str, numbers, bools, None, lists, dicts)."""
    try:
        return json.dumps(dict(properties), separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise EncodeError(f"with a backlog, an event's headers and properties must be JSON values: {exc}") from exc


def decode_properties(text: str) -> dict[str, Any]:
    """Properties as :func:`encode_properties` stored them."""
    properties: dict[str, Any] = json.loads(text)
    return properties


@dataclass(frozen=True)
class Stored:
    """One event in the backlog."""

    seq: int
    stored_at: float
    exchange: str
    routing_key: str
    body: bytes
    properties: dict[str, Any]

    def message(self) -> Message:
        """The message to publish: the same body bytes and properties as when it was stored."""
        return Message(self.body, **self.properties)


@dataclass(frozen=True)
class BacklogStatus:
    """What ``kombu-events backlog status`` shows."""

    path: str
    depth: int
    rejected: int
    oldest_stored_at: float | None
    used_bytes: int
    max_bytes: int

    def age_s(self, now: float) -> float | None:
        """Seconds the oldest waiting event has waited (None if none waits)."""
        return None if self.oldest_stored_at is None else max(0.0, now - self.oldest_stored_at)

    def as_dict(self, now: float) -> dict[str, Any]:
        """JSON-ready."""
        age = self.age_s(now)
        return {"path": self.path, "depth": self.depth, "rejected": self.rejected,
                "oldest_age_s": None if age is None else round(age, 3), "used_bytes": self.used_bytes,
                "max_bytes": self.max_bytes}


class Backlog:
    """A SQLite backlog at ``path``; ``max_bytes`` bounds it (then storing raises
    :class:`~kombu_events.errors.BacklogFullError`)."""

    def __init__(self, path: str | os.PathLike[str], *, max_bytes: int = DEFAULT_MAX_BYTES,
                 busy_timeout_s: float = 30.0, batch_size: int = 200) -> None:
        self.path = os.fspath(path)
        _check_limits(max_bytes, busy_timeout_s, batch_size)
        self.max_bytes, self.busy_timeout_s, self.batch_size = max_bytes, busy_timeout_s, batch_size
        self._lock = threading.Lock()
        self._db: sqlite3.Connection | None = None
        self._pid = 0

    def check(self) -> None:
        """Create the file and its tables now; an unusable path raises :class:`ConfigurationError`."""
        try:
            with self._reading():
                pass
            self.close()  # Events(...) runs at import, often before a fork: no connection crosses it
            with open(self.lock_path, "a"):
                pass
        except (BacklogError, OSError) as exc:
            raise ConfigurationError(f"backlog={self.path!r} cannot be used: {exc} (the directory must exist "
                                     "and be writable by every process that publishes)") from exc

    @property
    def lock_path(self) -> str:
        """The file whose ``flock`` the one running flusher holds."""
        return self.path + ".lock"

    def _connect(self) -> sqlite3.Connection:
        if self._db is not None and self._pid == os.getpid():
            return self._db
        if self._db is not None:  # inherited through fork: never used, and never closed here (see _INHERITED)
            _INHERITED.append(self._db)
        db = sqlite3.connect(self.path, timeout=self.busy_timeout_s, isolation_level=None,
                             check_same_thread=False)
        db.execute(f"PRAGMA busy_timeout = {int(self.busy_timeout_s * 1000)}")
        _set_up(db, deadline=time.monotonic() + self.busy_timeout_s)
        db.execute("PRAGMA synchronous = FULL")
        self._db, self._pid = db, os.getpid()
        return db

    @contextmanager
    def _reading(self) -> Iterator[sqlite3.Connection]:
        with self._lock, _wrapped(self.path):
            yield self._connect()

    @contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        """``BEGIN IMMEDIATE``: the write lock up front, so readers never have to upgrade and deadlock."""
        with self._lock, _wrapped(self.path):
            db = self._connect()
            db.execute("BEGIN IMMEDIATE")
            try:
                yield db
            except BaseException:
                db.execute("ROLLBACK")
                raise
            db.execute("COMMIT")

    def store(self, items: Sequence[tuple[str, str, Message]], *, now: float | None = None) -> list[int]:
        """Append events in order, in one transaction; return their sequence numbers."""
        stored_at = time.time() if now is None else now
        rows = [(stored_at, exchange, routing_key, message.properties.get("message_id"),
                 encode_properties(message.properties), _body(message))
                for exchange, routing_key, message in items]
        incoming = sum(len(r[4]) + len(r[5]) + 64 for r in rows)
        with self._transaction() as db:
            used = _used_bytes(db)
            if used + incoming > self.max_bytes:
                raise BacklogFullError(
                    f"the broker is unavailable and the backlog {self.path} is full ({used} of max_bytes="
                    f"{self.max_bytes} bytes used): the event was not stored; raise max_bytes or bring the "
                    "broker back (`kombu-events backlog status`)")
            return [db.execute("INSERT INTO events (stored_at, exchange, routing_key, message_id, properties, "
                               "body) VALUES (?, ?, ?, ?, ?, ?)", row).lastrowid or 0 for row in rows]

    def pending(self) -> bool:
        """Whether some event waits to be flushed."""
        with self._reading() as db:
            row = db.execute("SELECT EXISTS (SELECT 1 FROM events WHERE rejected IS NULL)").fetchone()
        return bool(row[0])

    def head(self, limit: int | None = None) -> list[Stored]:
        """The oldest waiting events, in order."""
        with self._reading() as db:
            rows = db.execute(
                "SELECT seq, stored_at, exchange, routing_key, body, properties FROM events "
                "WHERE rejected IS NULL ORDER BY seq LIMIT ?", (limit or self.batch_size,)).fetchall()
        return [Stored(seq, at, x, k, bytes(body), decode_properties(p)) for seq, at, x, k, body, p in rows]

    def settle(self, confirmed: Sequence[int], rejected: Sequence[tuple[int, str]] = ()) -> None:
        """Delete confirmed events and set aside rejected ones, in one transaction."""
        with self._transaction() as db:
            db.executemany("DELETE FROM events WHERE seq = ?", [(seq,) for seq in confirmed])
            db.executemany("UPDATE events SET rejected = ? WHERE seq = ?", [(why, seq) for seq, why in rejected])

    def retry_rejected(self) -> int:
        """Put rejected events back in line (after binding a queue for them); return how many."""
        with self._transaction() as db:
            return db.execute("UPDATE events SET rejected = NULL WHERE rejected IS NOT NULL").rowcount

    def rejected(self, limit: int = 100) -> list[tuple[int, str, str, str]]:
        """Rejected events: (seq, routing key, message id, why)."""
        with self._reading() as db:
            return [tuple(r) for r in db.execute(
                "SELECT seq, routing_key, message_id, rejected FROM events WHERE rejected IS NOT NULL "
                "ORDER BY seq LIMIT ?", (limit,))]

    def status(self) -> BacklogStatus:
        """Depth, rejected count, when the oldest waiting event was stored, bytes used."""
        with self._reading() as db:
            depth, oldest = db.execute("SELECT COUNT(*), MIN(stored_at) FROM events WHERE rejected IS NULL"
                                       ).fetchone()
            rejected = db.execute("SELECT COUNT(*) FROM events WHERE rejected IS NOT NULL").fetchone()[0]
            used = _used_bytes(db)
        return BacklogStatus(self.path, depth, rejected, oldest, used, self.max_bytes)

    @contextmanager
    def flush_lock(self) -> Iterator[bool]:
        """Hold the flusher's lock if nobody else does: yields True if held, False if another flusher runs."""
        import fcntl

        fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                yield False
                return
            yield True
        finally:
            os.close(fd)  # closing the descriptor releases the lock

    def close(self) -> None:
        """Close this process's connection (it reopens on next use)."""
        with self._lock:
            if self._db is not None and self._pid == os.getpid():
                self._db.close()
            self._db = None

    def __repr__(self) -> str:
        return f"<Backlog {self.path!r}>"


def open_backlog(option: str | os.PathLike[str] | Backlog | None) -> Backlog | None:
    """``Events(backlog=...)``: None, a path, or a Backlog; checked now (an unusable path fails at start-up)."""
    if option is None:
        return None
    if isinstance(option, (str, os.PathLike)):
        option = Backlog(option)
    if not isinstance(option, Backlog):
        raise ConfigurationError(f"backlog must be a file path or a Backlog, got {option!r}")
    option.check()
    return option


def _set_up(db: sqlite3.Connection, deadline: float) -> None:
    """WAL mode and the tables, retried while another process does the same (until ``deadline``).

    Switching a new file to WAL takes an exclusive lock for which SQLite does not wait
    (``database is locked`` at once), so processes that start together (gunicorn's
    workers) take turns here; the mode is kept in the file, so later opens only read it.
    """
    while True:
        try:
            if str(db.execute("PRAGMA journal_mode").fetchone()[0]).lower() != "wal":
                db.execute("PRAGMA journal_mode = WAL")
            db.executescript(_SCHEMA)
            return
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or time.monotonic() > deadline:
                raise
            time.sleep(0.005 + 0.02 * (os.getpid() % 7) / 7)  # apart, so they do not collide again


@contextmanager
def _wrapped(path: str) -> Iterator[None]:
    """SQLite's errors (locked past the busy timeout, disk I/O, a corrupt file) as :class:`BacklogError`."""
    try:
        yield
    except sqlite3.Error as exc:
        raise BacklogError(f"backlog {path}: {type(exc).__name__}: {exc}") from exc


def _body(message: Message) -> bytes:
    body = message.body
    return body.encode("utf-8") if isinstance(body, str) else bytes(body)


def _used_bytes(db: sqlite3.Connection) -> int:
    """Bytes the database's live pages take (free pages left by deleted rows are reused, not counted)."""
    page_size = db.execute("PRAGMA page_size").fetchone()[0]
    pages = db.execute("PRAGMA page_count").fetchone()[0] - db.execute("PRAGMA freelist_count").fetchone()[0]
    return int(page_size * pages)


def _check_limits(max_bytes: object, busy_timeout_s: object, batch_size: object) -> None:
    if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 64 * 1024:
        raise ConfigurationError(f"backlog max_bytes must be an integer of at least 65536, got {max_bytes!r}")
    if isinstance(busy_timeout_s, bool) or not isinstance(busy_timeout_s, (int, float)) \
            or not 0 < busy_timeout_s <= 3600:
        raise ConfigurationError(f"backlog busy_timeout_s must be within (0, 3600] seconds, got {busy_timeout_s!r}")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or not 1 <= batch_size <= 10_000:
        raise ConfigurationError(f"backlog batch_size must be an integer within 1 .. 10000, got {batch_size!r}")
