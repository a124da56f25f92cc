"""The outbox: ``events.publish`` inside an open transaction writes the event into the outbox table instead.

The row commits or rolls back with the caller's transaction; once committed, the relay
(:mod:`kombu_events.database.relay`) publishes it with confirms and deletes it. The
message is built here, at publish time: its ``message_id``, headers and body are final,
so a row published twice (a relay that died between the confirm and the delete) is the
same event twice, which a subscriber's inbox drops.
"""
from __future__ import annotations

__all__ = ["Outbox", "OutboxStatus", "status"]

import json
import logging
import time
from typing import Any, Mapping, NamedTuple

from ..core import names
from ..errors import EncodeError
from ..publishing.published import Published
from ..publishing.publisher import addressed, build_message
from ..publishing.service import ServicePublisher
from . import schema
from .backends import Backend, Transaction

logger = logging.getLogger(__name__)


class Outbox:
    """Where ``events.publish`` writes while a transaction of ``backend`` is open."""

    def __init__(self, backend: Backend, publishing: ServicePublisher) -> None:
        self.backend = backend
        self.publishing = publishing

    def transaction(self, using: Any = None) -> Transaction | None:
        """The caller's open transaction (``using``: an SQLAlchemy Session or Connection), else None."""
        return self.backend.current(using)

    def write(self, transaction: Transaction, routing_key: str, payload: Any, *,
              headers: Mapping[str, Any] | None = None, message_id: str | None = None,
              correlation_id: str | None = None, delay: float = 0) -> Published:
        """Insert the event in ``transaction``; return its ``message_id`` (``stored_locally``: not confirmed yet).

        Validated and encoded as ``events.publish`` does, and ``before_publish`` runs now,
        so a payload that does not fit fails here, in the caller's transaction.
        """
        names.validate_name("routing_key", routing_key)
        payload = self.publishing.checked(routing_key, payload)
        message = build_message(payload, message_id=message_id, correlation_id=correlation_id, headers=headers)
        exchange, key = addressed(self.publishing.topology, routing_key, message, delay)
        if self.publishing.hooks.on_before_publish:
            self.publishing.hooks.before_publish(exchange, key, message.properties)
        try:
            properties = json.dumps(message.properties, separators=(",", ":"), allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise EncodeError(f"headers of an event written to the outbox must be JSON values: {exc}") from exc
        transaction.execute(schema.insert_outbox(), {"exchange": exchange, "routing_key": key, "body": message.body,
                                                     "properties": properties, "now": time.time()})
        return Published(message.properties["message_id"], stored_locally=True)


class OutboxStatus(NamedTuple):
    """What waits in the outbox: rows, the oldest one's age, and rows whose publish failed at least once."""

    depth: int
    oldest_age_s: float | None
    failing: int

    def as_json(self) -> dict[str, Any]:
        """The ``kombu-events outbox status --json`` document (cli/schemas/outbox-status.json)."""
        age = None if self.oldest_age_s is None else round(self.oldest_age_s, 3)
        return {"depth": self.depth, "oldest_age_s": age, "failing": self.failing}


def status(backend: Backend, *, now: float | None = None) -> OutboxStatus:
    """Read the outbox's depth and the age of its oldest row (in a short transaction of its own)."""
    transaction = backend.begin()
    try:
        _, rows = transaction.execute(schema.outbox_status(), {})
    finally:
        transaction.rollback()
    depth, oldest, failing = rows[0] if rows else (0, None, 0)
    age = None if oldest is None else max(0.0, (time.time() if now is None else now) - float(oldest))
    return OutboxStatus(int(depth or 0), age, int(failing or 0))
