"""The inbox and outbox tables: their names, the dedup key of an event, and the SQL both backends run.

Pure: no connection here. The same two tables serve Django (the migrations of the
``kombu_events.django`` app) and SQLAlchemy (:mod:`kombu_events.database.tables`), and the
same statements run on PostgreSQL and SQLite; only the claim of outbox rows differs
(``FOR UPDATE SKIP LOCKED`` where the database has it).
"""
from __future__ import annotations

__all__ = ["INBOX", "OUTBOX", "dedup_key", "MAX_KEY_CHARS", "insert_inbox", "prune_inbox", "insert_outbox",
           "claim_outbox", "delete_outbox", "failed_outbox", "outbox_status"]

import hashlib
from typing import Any, Callable

from ..errors import ConfigurationError

INBOX = "kombu_events_inbox"
OUTBOX = "kombu_events_outbox"

#: Longest dedup key the inbox stores (its column is varchar(255)).
MAX_KEY_CHARS = 255


def dedup_key(once: bool | Callable[[Any], str], event: Any) -> str:
    """The inbox key of ``event``: ``once(event)`` for a callable, else its ``message_id``, else a hash.

    The hash (``sha256:`` + hex) covers the routing key and the body as received: two
    events a publisher sent without a message id are one event when both are equal.
    """
    if callable(once) and not isinstance(once, bool):
        key = once(event)
        if not isinstance(key, str) or not key or len(key) > MAX_KEY_CHARS:
            raise ConfigurationError(f"once= of the handler of {event.queue} returned {key!r}: it must return a "
                                     f"non-empty string of at most {MAX_KEY_CHARS} characters")
        return key
    message_id = event.message_id
    if isinstance(message_id, str) and message_id and len(message_id) <= MAX_KEY_CHARS:
        return message_id
    digest = hashlib.sha256(event.routing_key.encode("utf-8") + b"\0" + bytes(event.body or b""))
    return "sha256:" + digest.hexdigest()


def insert_inbox() -> str:
    """Insert the key of an event of a queue: one row inserted if new, none if already there (committed)."""
    return (f"INSERT INTO {INBOX} (queue, dedup_key, handled_at) VALUES (:queue, :key, :now) "
            "ON CONFLICT (queue, dedup_key) DO NOTHING")


def delete_inbox() -> str:
    """Delete the key of an event of a queue (a batch's failed event, whose row must not commit)."""
    return f"DELETE FROM {INBOX} WHERE queue = :queue AND dedup_key = :key"


def prune_inbox() -> str:
    """Delete the inbox rows handled before ``:cutoff`` (seconds since the epoch)."""
    return f"DELETE FROM {INBOX} WHERE handled_at < :cutoff"


def insert_outbox() -> str:
    """Insert one event to publish once the transaction commits."""
    return (f"INSERT INTO {OUTBOX} (exchange, routing_key, body, properties, created_at, not_before, "
            "attempts, last_error) VALUES (:exchange, :routing_key, :body, :properties, :now, 0, 0, '')")


def claim_outbox(dialect: str) -> str:
    """Select the oldest ``:limit`` rows; on PostgreSQL, lock them and skip those another relay holds."""
    select = (f"SELECT id, exchange, routing_key, body, properties FROM {OUTBOX} "
              "WHERE not_before <= :now ORDER BY id LIMIT :limit")
    return select + (" FOR UPDATE SKIP LOCKED" if dialect == "postgresql" else "")


def delete_outbox(count: int) -> str:
    """Delete the rows ``:id0`` .. ``:id<count-1>`` (published and confirmed)."""
    return f"DELETE FROM {OUTBOX} WHERE id IN ({', '.join(f':id{i}' for i in range(count))})"


def failed_outbox() -> str:
    """Count a failed attempt of row ``:id``, say why, and leave it until ``:not_before``."""
    return (f"UPDATE {OUTBOX} SET attempts = attempts + 1, last_error = :error, not_before = :not_before "
            "WHERE id = :id")


def outbox_status() -> str:
    """Rows waiting, the oldest one's ``created_at``, and rows that failed at least once."""
    return (f"SELECT COUNT(*), MIN(created_at), COALESCE(SUM(CASE WHEN attempts > 0 THEN 1 ELSE 0 END), 0) "
            f"FROM {OUTBOX}")
