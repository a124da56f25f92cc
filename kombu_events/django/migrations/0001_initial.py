"""Create the inbox and outbox tables."""
from __future__ import annotations

from typing import Any, ClassVar

from django.db import migrations, models


class Migration(migrations.Migration):
    """The first and only migration so far."""

    initial = True
    dependencies: ClassVar[list[tuple[str, str]]] = []

    operations: ClassVar[list[Any]] = [
        migrations.CreateModel(
            name="InboxEntry",
            fields=[
                ("id", models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name="ID")),
                ("queue", models.CharField(max_length=255)),
                ("dedup_key", models.CharField(max_length=255)),
                ("handled_at", models.FloatField(db_index=True)),
            ],
            options={"db_table": "kombu_events_inbox"},
        ),
        migrations.CreateModel(
            name="OutboxEntry",
            fields=[
                ("id", models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name="ID")),
                ("exchange", models.CharField(max_length=255)),
                ("routing_key", models.CharField(max_length=255)),
                ("body", models.BinaryField()),
                ("properties", models.TextField()),
                ("created_at", models.FloatField()),
                ("not_before", models.FloatField(db_index=True, default=0)),
                ("attempts", models.IntegerField(default=0)),
                ("last_error", models.TextField(blank=True, default="")),
            ],
            options={"db_table": "kombu_events_outbox"},
        ),
        migrations.AddConstraint(
            model_name="inboxentry",
            constraint=models.UniqueConstraint(fields=("queue", "dedup_key"), name="kombu_events_inbox_unique"),
        ),
    ]
