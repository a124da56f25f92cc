"""The inbox: a ``once=True`` handler runs in a transaction that also records its event, so it commits once.

:class:`Inbox` is the middleware ``Events(database=...)`` adds. Around the handler of a
``once`` queue it begins a transaction, inserts (handler queue, dedup key) into the inbox
table, and commits after the handler returned; a handler that raises rolls both back.
An event whose row is already committed raises :class:`~kombu_events.middleware.base.Handled`
on entering: the message is acked without calling the handler. A database that cannot
be reached raises ``Retry``: the message comes back later, as a failing handler's would.
"""
from __future__ import annotations

__all__ = ["Inbox", "prune"]

import logging
import time
from contextlib import AbstractContextManager, nullcontext
from types import TracebackType
from typing import Any, Callable, Mapping

from ..core.event import Event
from ..core.logs import escape_controls
from ..errors import Archive, BatchFailed, KombuEventsError, Retry
from ..middleware.base import Handled, Middleware
from . import backends, schema
from .backends import Backend, Transaction

logger = logging.getLogger(__name__)

Once = Callable[[], Mapping[str, Any]]


class Inbox(Middleware):
    """Run the handlers of the queues ``once_by_queue()`` names once per dedup key, in ``backend``'s transactions."""

    def __init__(self, backend: Backend, once_by_queue: Once) -> None:
        self.backend = backend
        self._once_by_queue = once_by_queue
        self._once: Mapping[str, Any] | None = None

    def handling(self, event: Event[Any]) -> AbstractContextManager[Any]:
        if self._once is None:
            self._once = dict(self._once_by_queue())
        once = self._once.get(event.queue)
        if not once:
            return nullcontext()
        try:
            key = schema.dedup_key(once, event)
        except Exception as exc:  # running the handler without its key would not be once: never do that
            raise Archive(f"no inbox key for this event: {type(exc).__name__}: {exc}") from exc
        return _Once(self.backend, event.queue, key)

    def handling_batch(self, events: list[Event[Any]]) -> AbstractContextManager[Any] | None:
        """A batch handler's call: one transaction, one inbox row per event; those handled before are left out."""
        if self._once is None:
            self._once = dict(self._once_by_queue())
        once = self._once.get(events[0].queue) if events else None
        if not once:
            return nullcontext()
        try:
            keys = [schema.dedup_key(once, event) for event in events]
        except Exception as exc:
            raise Archive(f"no inbox key for an event of this batch: {type(exc).__name__}: {exc}") from exc
        return _OnceBatch(self.backend, events[0].queue, keys)

    def __repr__(self) -> str:
        return f"<Inbox {self.backend.name}>"


class _Once:
    """One handler call in a transaction with its inbox row."""

    def __init__(self, backend: Backend, queue: str, key: str) -> None:
        self.backend = backend
        self.queue = queue
        self.key = key
        self._transaction: Transaction | None = None
        self._token: Any = None

    def __enter__(self) -> _Once:
        try:
            transaction = self.backend.begin()
        except Exception as exc:
            raise _retry("beginning a transaction", self, exc) from exc
        try:
            inserted, _ = transaction.execute(schema.insert_inbox(),
                                              {"queue": self.queue, "key": self.key, "now": time.time()})
        except Exception as exc:
            _quietly(transaction.rollback)
            raise _retry("inserting its inbox row", self, exc) from exc
        if inserted != 1:  # a committed row: handled before (a concurrent one waited for its commit)
            _quietly(transaction.rollback)
            logger.info("kombu-events: %s: event %r was handled before (inbox); acked without running the handler",
                        self.queue, self.key)
            raise Handled(self.key)
        self._transaction = transaction
        self._token = backends._current.set(transaction)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        transaction, self._transaction = self._transaction, None
        backends._current.reset(self._token)
        if transaction is None:
            return
        if exc_type is not None:
            _quietly(transaction.rollback)
            return
        try:
            transaction.commit()
        except Exception as error:  # not committed (or not known to be): the retry finds out from the inbox
            raise _retry("committing", self, error) from error


class _OnceBatch(_Once):
    """One call of a batch handler in a transaction with the inbox row of each of its events."""

    def __init__(self, backend: Backend, queue: str, keys: list[str]) -> None:
        super().__init__(backend, queue, f"{len(keys)} events")
        self.keys = keys
        self.handled: set[int] = set()

    def __enter__(self) -> set[int]:  # type: ignore[override]
        try:
            transaction = self.backend.begin()
        except Exception as exc:
            raise _retry("beginning a transaction", self, exc) from exc
        try:
            for index, key in enumerate(self.keys):
                inserted, _ = transaction.execute(schema.insert_inbox(),
                                                  {"queue": self.queue, "key": key, "now": time.time()})
                if inserted != 1:  # handled before (or twice in this batch): left out, acked
                    self.handled.add(index)
        except Exception as exc:
            _quietly(transaction.rollback)
            raise _retry("inserting its inbox rows", self, exc) from exc
        if self.handled:
            logger.info("kombu-events: %s: %d event(s) of a batch were handled before (inbox); acked without "
                        "passing them to the handler", self.queue, len(self.handled))
        self._transaction = transaction
        self._token = backends._current.set(transaction)
        return set(self.handled)

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        failed = getattr(exc, "failures", None) if isinstance(exc, BatchFailed) else None
        transaction = self._transaction
        if failed and transaction is not None:  # the others succeeded: commit them, without the failed' rows
            try:
                for index in failed:
                    transaction.execute(schema.delete_inbox(), {"queue": self.queue, "key": self.keys[index]})
            except Exception as error:
                super().__exit__(type(error), error, error.__traceback__)  # rolled back: every event is retried
                raise _retry("deleting the rows of its failed events", self, error) from error
            exc_type = exc = tb = None
        super().__exit__(exc_type, exc, tb)


def _retry(doing: str, once: _Once, exc: Exception) -> Retry:
    logger.warning("kombu-events: %s: %s for event %r failed in %s: %s: %s; retried later", once.queue, doing,
                   once.key, once.backend.name, type(exc).__name__, escape_controls(exc))
    return Retry(None, f"inbox of {once.backend.name}: {doing} failed: {type(exc).__name__}: {exc}")


def _quietly(action: Callable[[], Any]) -> None:
    try:
        action()
    except Exception:
        logger.exception("kombu-events: rolling back an inbox transaction failed")


def prune(backend: Backend, *, older_than_s: float, now: float | None = None) -> int:
    """Delete the inbox rows handled more than ``older_than_s`` seconds ago; return how many."""
    if older_than_s <= 0:
        raise KombuEventsError(f"older_than_s must be > 0, got {older_than_s!r}")
    cutoff = (time.time() if now is None else now) - older_than_s
    transaction = backend.begin()
    try:
        deleted, _ = transaction.execute(schema.prune_inbox(), {"cutoff": cutoff})
    except BaseException:
        transaction.rollback()
        raise
    transaction.commit()
    return max(deleted, 0)
