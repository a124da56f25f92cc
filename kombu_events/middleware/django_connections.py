"""Django's database connections around each handler, as Celery's Django fix-up tidies them around tasks.

Celery closes a Django project's connections before and after every *task*
(``task_prerun``/``task_postrun``); handlers are not tasks, so without this a
handler would keep a connection the database may have dropped since the last one
("server closed the connection unexpectedly"). When ``DJANGO_SETTINGS_MODULE`` is set
and Django is installed, :class:`~kombu_events.Events` adds :class:`DjangoConnections`
to the service's middleware by itself. The ``django_connections`` setting chooses:

- ``close`` (default): close every connection before and after each handler, as
  Celery does for tasks; caches are closed after it too;
- ``max_age``: Django's ``close_old_connections()`` before and after, as Django does
  around a request: honours ``CONN_MAX_AGE`` (and ``CONN_HEALTH_CHECKS``);
- ``off``: leave connections alone.
"""
from __future__ import annotations

__all__ = ["DjangoConnections", "middleware_for", "ENV"]

import importlib
import importlib.util
import logging
import os
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any, Callable, Iterator, Mapping

from ..core.event import Event
from .base import Middleware

logger = logging.getLogger(__name__)

#: Set in a Django project's worker (Celery's own Django fix-up looks for it too).
ENV = "DJANGO_SETTINGS_MODULE"


def middleware_for(mode: Callable[[], str], environ: Mapping[str, str] | None = None) -> list[Middleware]:
    """``[DjangoConnections(mode)]`` in a Django project (``DJANGO_SETTINGS_MODULE`` set), else ``[]``."""
    environ = os.environ if environ is None else environ
    if not environ.get(ENV):
        return []
    if importlib.util.find_spec("django") is None:
        logger.warning("kombu-events: %s is set but Django is not installed: handlers' connections are not closed",
                       ENV)
        return []
    return [DjangoConnections(mode)]


class DjangoConnections(Middleware):
    """Close (or recycle) Django's database connections before and after each handler, in the pool process.

    ``mode()`` returns ``close``, ``max_age`` or ``off``; it is read at the first
    handler call, once the service's settings are resolved. ``db`` and ``cache`` stand
    in for ``django.db`` and ``django.core.cache`` (tests).
    """

    def __init__(self, mode: Callable[[], str], *, db: Any = None, cache: Any = None) -> None:
        self._mode = mode
        self._chosen: str | None = None
        self._db = db
        self._cache = cache

    def handling(self, event: Event) -> AbstractContextManager[Any]:
        """Tidy connections before the handler and after it, whether it returned or raised."""
        if self._chosen is None:
            self._chosen = self._mode()
        if self._chosen == "off":
            return nullcontext()
        return self._around(self._chosen)

    @contextmanager
    def _around(self, mode: str) -> Iterator[None]:
        self._tidy(mode)
        try:
            yield
        finally:
            self._tidy(mode)
            self._close_caches()

    def _tidy(self, mode: str) -> None:
        db = self._django_db()
        if mode == "max_age":
            db.close_old_connections()
            return
        try:
            connections = db.connections.all(initialized_only=True)
        except TypeError:  # Django < 4.1
            connections = db.connections.all()
        for connection in connections:
            _close(db, connection)

    def _close_caches(self) -> None:
        if self._cache is None:
            self._cache = importlib.import_module("django.core.cache")
        try:
            self._cache.close_caches()
        except (TypeError, AttributeError):  # as Celery: an old or odd cache backend
            pass

    def _django_db(self) -> Any:
        if self._db is None:
            self._db = importlib.import_module("django.db")
        return self._db


def _close(db: Any, connection: Any) -> None:
    """Close one connection; one that is already closed or broken is fine (Celery's rule)."""
    try:
        connection.close()
    except db.InterfaceError:
        pass
    except db.DatabaseError as exc:
        text = str(exc)
        if "closed" not in text and "not connected" not in text:
            raise
