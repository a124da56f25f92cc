"""Effectively once with the application's database: the inbox of ``once=True`` handlers, the outbox and its relay.

``Events(app, service=..., database="django")`` (or ``"django:<alias>"``, or an SQLAlchemy
``Engine``) keeps both tables in that database; ``outbox=True`` makes ``events.publish``
inside an open transaction write to the outbox. See docs/effectively-once.md.
"""
from __future__ import annotations

__all__ = ["backend_for", "session", "current", "Backend", "Inbox", "Outbox", "OutboxStatus", "status", "Relay",
           "RelayThread", "upkeep"]

from typing import Callable, cast

from ..publishing.service import ServicePublisher
from ..registry import EventsService
from .backends import Backend, backend_for, current, session
from .inbox import Inbox
from .outbox import Outbox, OutboxStatus, status
from .relay import Relay, RelayThread


def upkeep(events: EventsService, *, on_pass: Callable[[], None] | None = None) -> RelayThread | None:
    """What a worker of ``events`` runs for its database: the relay (``outbox=True``) and the inbox's pruning.

    None when the service has no ``database=``. The inbox is pruned of rows older than
    the ``inbox_retention_ms`` setting (default: the archive's TTL; 0: never).
    """
    # The registry's layer cannot name this layer's Backend nor publishing's ServicePublisher: Events sets both.
    backend = cast("Backend | None", events.database)
    if backend is None:
        return None
    settings = events.settings
    relay = Relay(backend, cast(ServicePublisher, events.publishing), batch_size=settings.outbox_batch_size) \
        if events.outbox is not None else None
    retention_ms = settings.archive_ttl_ms if settings.inbox_retention_ms is None else settings.inbox_retention_ms
    uses_inbox = any(h.once for h in events.handlers)
    if relay is None and not (uses_inbox and retention_ms):
        return None
    return RelayThread(backend, relay, poll_interval_s=settings.outbox_poll_interval_ms / 1000,
                       inbox_retention_s=retention_ms / 1000 if uses_inbox and retention_ms else None,
                       on_pass=on_pass)
