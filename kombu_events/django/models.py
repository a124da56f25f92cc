"""The inbox and outbox tables as Django models (the same columns as :mod:`kombu_events.database.tables`).

kombu-events reads and writes them with SQL of its own (:mod:`kombu_events.database.schema`);
the models are here for the migrations and for the Django admin or shell.
"""
from __future__ import annotations

__all__ = ["InboxEntry", "OutboxEntry"]

from typing import Any, ClassVar

from django.db import models


class InboxEntry(models.Model):
    """An event a ``once=True`` handler's transaction committed: (handler queue, dedup key)."""

    queue = models.CharField(max_length=255)
    dedup_key = models.CharField(max_length=255)
    handled_at = models.FloatField(db_index=True)

    class Meta:
        db_table = "kombu_events_inbox"
        constraints: ClassVar[list[Any]] = [
            models.UniqueConstraint(fields=["queue", "dedup_key"], name="kombu_events_inbox_unique")]


class OutboxEntry(models.Model):
    """An event published inside a committed transaction, until the relay's publish is confirmed."""

    exchange = models.CharField(max_length=255)
    routing_key = models.CharField(max_length=255)
    body = models.BinaryField()
    properties = models.TextField()
    created_at = models.FloatField()
    not_before = models.FloatField(default=0, db_index=True)
    attempts = models.IntegerField(default=0)
    last_error = models.TextField(default="", blank=True)

    class Meta:
        db_table = "kombu_events_outbox"
