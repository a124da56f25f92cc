"""The Django app of kombu-events: its migrations create the inbox and outbox tables (docs/effectively-once.md)."""
from __future__ import annotations

__all__ = ["KombuEventsConfig"]

from django.apps import AppConfig


class KombuEventsConfig(AppConfig):
    """``INSTALLED_APPS = [..., "kombu_events.django"]``; ``manage.py migrate`` creates the tables."""

    name = "kombu_events.django"
    label = "kombu_events"
    verbose_name = "kombu-events"
    default_auto_field = "django.db.models.BigAutoField"
