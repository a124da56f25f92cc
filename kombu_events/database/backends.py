"""The two ways to reach the application's database: Django's connection of an alias, or an SQLAlchemy Engine.

Both give the inbox, the outbox and the relay the same small surface: begin a
transaction of their own (:meth:`Backend.begin`), find the transaction the caller has
open (:meth:`Backend.current`, for ``events.publish``), and run the SQL of
:mod:`kombu_events.database.schema` (written with ``:name`` parameters) in either.
"""
from __future__ import annotations

__all__ = ["Backend", "Transaction", "DjangoBackend", "SQLAlchemyBackend", "backend_for", "current", "session"]

import contextvars
import logging
import os
import re
import weakref
from typing import Any, Mapping, Protocol

from ..errors import ConfigurationError

logger = logging.getLogger(__name__)

Rows = list[tuple[Any, ...]]

_PARAMETER = re.compile(r"(?<![:\w]):(\w+)")

#: The transaction of the ``once=True`` handler running in this thread (set by the inbox).
_current: contextvars.ContextVar[Transaction | None] = contextvars.ContextVar("kombu_events_transaction",
                                                                              default=None)


class Transaction(Protocol):
    """An open transaction: run SQL in it, then commit or roll back (once)."""

    backend: Backend

    def execute(self, sql: str, params: Mapping[str, Any]) -> tuple[int, Rows]:
        """Run ``sql``; return (rows affected, rows returned)."""

    def commit(self) -> None:
        """Commit and give the connection back."""

    def rollback(self) -> None:
        """Roll back and give the connection back."""


class Backend(Protocol):
    """A database kombu-events keeps its inbox and outbox in."""

    #: ``django:<alias>`` or ``sqlalchemy:<url without password>``, for logs and the CLI.
    name: str

    @property
    def dialect(self) -> str:
        """``postgresql``, ``sqlite``, ... (as SQLAlchemy and Django's ``vendor`` say)."""

    def begin(self) -> Transaction:
        """A new transaction on a connection of this thread."""

    def current(self, using: Any = None) -> Transaction | None:
        """The transaction ``events.publish`` is called in (``using``: the caller's own), or None."""


def current() -> Transaction | None:
    """The transaction of the ``once=True`` handler running in this thread, if any."""
    return _current.get()


def session() -> Any:
    """The SQLAlchemy ``Session`` of the running ``once=True`` handler's transaction.

    Its writes commit together with the inbox row, after the handler returns; the
    handler must not commit or roll back itself (a ``commit()`` is ignored, a raise
    rolls back). Raises ``RuntimeError`` outside such a handler, or for a Django database.
    """
    transaction = _current.get()
    if not isinstance(transaction, _SQLAlchemyTransaction):
        raise RuntimeError("kombu_events.database.session() is only available inside a once=True handler of a "
                           "service whose database= is an SQLAlchemy Engine")
    return transaction.session


def _positional(sql: str, params: Mapping[str, Any]) -> tuple[str, list[Any]]:
    """``:name`` parameters as DB-API ``%s`` ones, for Django's cursors."""
    values: list[Any] = []

    def replace(match: re.Match[str]) -> str:
        values.append(params[match.group(1)])
        return "%s"

    return _PARAMETER.sub(replace, sql), values


class DjangoBackend:
    """Django's database ``alias`` (``"default"`` unless ``database="django:<alias>"``)."""

    def __init__(self, alias: str = "default") -> None:
        self.alias = alias
        self.name = f"django:{alias}"

    @property
    def dialect(self) -> str:
        from django.db import connections
        return str(connections[self.alias].vendor)

    def begin(self) -> Transaction:
        from django.db import transaction
        atomic = transaction.atomic(using=self.alias)
        atomic.__enter__()
        return _DjangoTransaction(self, atomic)

    def current(self, using: Any = None) -> Transaction | None:
        if using is not None:
            raise ConfigurationError(f"publish(..., using=...) is for SQLAlchemy; with {self.name} an open "
                                     "transaction.atomic() block is found by itself")
        from django.db import transaction
        if not transaction.get_connection(self.alias).in_atomic_block:
            return None
        return _DjangoTransaction(self, None)

    def __repr__(self) -> str:
        return f"<DjangoBackend {self.name}>"


class _DjangoTransaction:
    """An ``atomic`` block of our own (``atomic`` given), or the caller's (None: never committed here)."""

    def __init__(self, backend: DjangoBackend, atomic: Any) -> None:
        self.backend: Backend = backend
        self._alias = backend.alias
        self._atomic = atomic

    def execute(self, sql: str, params: Mapping[str, Any]) -> tuple[int, Rows]:
        from django.db import connections
        query, values = _positional(sql, params)
        with connections[self._alias].cursor() as cursor:
            cursor.execute(query, values)
            rows = [tuple(r) for r in cursor.fetchall()] if cursor.description else []
            return cursor.rowcount, rows

    def commit(self) -> None:
        self._atomic.__exit__(None, None, None)

    def rollback(self) -> None:
        from django.db import transaction
        transaction.set_rollback(True, using=self._alias)
        self._atomic.__exit__(None, None, None)


#: Engines whose pooled connections a forked child must not share with its parent.
_forked: weakref.WeakSet[Any] = weakref.WeakSet()


def _dispose_after_fork() -> None:
    for engine in list(_forked):
        engine.dispose(close=False)  # the parent keeps its connections; the child opens its own


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_dispose_after_fork)


class SQLAlchemyBackend:
    """An SQLAlchemy ``Engine`` (SQLAlchemy 2.0 or later)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.name = f"sqlalchemy:{engine.url.render_as_string(hide_password=True)}"
        _forked.add(engine)

    @property
    def dialect(self) -> str:
        return str(self.engine.dialect.name)

    def begin(self) -> Transaction:
        connection = self.engine.connect()
        try:
            connection.begin()
        except BaseException:
            connection.close()
            raise
        return _SQLAlchemyTransaction(self, connection, own=True)

    def current(self, using: Any = None) -> Transaction | None:
        if using is None:
            transaction = _current.get()
            return transaction if transaction is not None and transaction.backend is self else None
        from sqlalchemy.engine import Connection
        from sqlalchemy.orm import Session
        if isinstance(using, Session):
            using = using.connection()
        if not isinstance(using, Connection):
            raise ConfigurationError(f"using= must be an SQLAlchemy Session or Connection in a transaction, got "
                                     f"{using!r}")
        if using.engine.url != self.engine.url:  # its rows would never reach this service's relay
            raise ConfigurationError(f"using= is a transaction of {using.engine.url.render_as_string()}, not of "
                                     f"the service's database {self.name}")
        return _SQLAlchemyTransaction(self, using, own=False)

    def __repr__(self) -> str:
        return f"<SQLAlchemyBackend {self.name}>"


class _SQLAlchemyTransaction:
    """A connection in a transaction; ``own``: ours to commit (else the caller's, who commits it)."""

    def __init__(self, backend: SQLAlchemyBackend, connection: Any, *, own: bool) -> None:
        self.backend: Backend = backend
        self.connection = connection
        self._own = own
        self._session: Any = None

    @property
    def session(self) -> Any:
        """A ``Session`` on this transaction: its ``commit()`` leaves the transaction to us."""
        if self._session is None:
            from sqlalchemy.orm import Session
            self._session = Session(bind=self.connection, join_transaction_mode="conditional_savepoint")
        return self._session

    def execute(self, sql: str, params: Mapping[str, Any]) -> tuple[int, Rows]:
        from sqlalchemy import text
        result = self.connection.execute(text(sql), dict(params))
        rows = [tuple(r) for r in result.fetchall()] if result.returns_rows else []
        return result.rowcount, rows

    def commit(self) -> None:
        try:
            if self._session is not None:
                self._session.flush()  # the handler's pending ORM changes go into this transaction
            self.connection.commit()
        finally:
            self._close()

    def rollback(self) -> None:
        try:
            self.connection.rollback()
        finally:
            self._close()

    def _close(self) -> None:
        if self._session is not None:
            self._session.close()
        if self._own:
            self.connection.close()


def backend_for(database: Any) -> Backend:
    """``"django"``, ``"django:<alias>"`` or an SQLAlchemy ``Engine`` as a :class:`Backend`."""
    if isinstance(database, str):
        kind, _, alias = database.partition(":")
        if kind == "django":
            return DjangoBackend(alias or "default")
    elif hasattr(database, "dialect") and hasattr(database, "connect") and hasattr(database, "url"):
        return SQLAlchemyBackend(database)
    raise ConfigurationError(f"database must be 'django', 'django:<alias>' or an SQLAlchemy Engine, got {database!r}")
