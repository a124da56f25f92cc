"""The inbox and outbox tables as SQLAlchemy ``Table`` objects in :data:`metadata` (for Alembic, or ``create_all``).

Needs SQLAlchemy (``pip install 'kombu-events[sqlalchemy]'``). Include them in an
Alembic environment with ``target_metadata = [Base.metadata, kombu_events.database.tables.metadata]``,
or create them with ``kombu-events -A APP outbox create-tables``. Django projects use the
migrations of the ``kombu_events.django`` app instead: the columns are the same.
"""
from __future__ import annotations

__all__ = ["metadata", "inbox", "outbox"]

from sqlalchemy import (
    BigInteger,
    Column,
    Float,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Table,
    Text,
    UniqueConstraint,
)

from .schema import INBOX, OUTBOX

metadata = MetaData()

#: SQLite gives an ``INTEGER PRIMARY KEY`` its rowid (ascending ids); elsewhere a 64-bit identity.
_Id = BigInteger().with_variant(Integer(), "sqlite")

inbox = Table(
    INBOX, metadata,
    Column("id", _Id, primary_key=True, autoincrement=True),
    Column("queue", String(255), nullable=False),
    Column("dedup_key", String(255), nullable=False),
    Column("handled_at", Float, nullable=False, index=True),
    UniqueConstraint("queue", "dedup_key", name="kombu_events_inbox_unique"),
)

outbox = Table(
    OUTBOX, metadata,
    Column("id", _Id, primary_key=True, autoincrement=True),
    Column("exchange", String(255), nullable=False),
    Column("routing_key", String(255), nullable=False),
    Column("body", LargeBinary, nullable=False),
    Column("properties", Text, nullable=False),
    Column("created_at", Float, nullable=False),
    Column("not_before", Float, nullable=False, default=0),
    Column("attempts", Integer, nullable=False, default=0),
    Column("last_error", Text, nullable=False, default=""),
)
Index("kombu_events_outbox_not_before", outbox.c.not_before)
