"""The relay: publish the outbox's committed rows with confirms, oldest id first, and delete each once confirmed.

One pass (:meth:`Relay.run_once`) claims up to ``batch_size`` rows in a transaction (on
PostgreSQL with ``FOR UPDATE SKIP LOCKED``, so relays in several workers share the
outbox without publishing a row twice), publishes them with pipelined confirms, deletes
the confirmed ones and commits. A relay that dies after the confirms and before the
commit leaves the rows there: the next pass publishes them again (at least once; the
``message_id`` is the same, so a subscriber's inbox drops the copy). :class:`RelayThread`
runs passes in a worker (and, with an inbox, prunes it); ``kombu-events outbox relay`` runs
the same loop in the foreground.
"""
from __future__ import annotations

__all__ = ["Relay", "RelayThread", "delete_published"]

import json
import logging
import threading
import time
from typing import Any, Callable

from amqp import Message

from .. import signals
from ..errors import BrokerUnavailableError
from ..publishing.service import ServicePublisher
from . import inbox, schema
from .backends import Backend, Transaction

logger = logging.getLogger(__name__)


def delete_published(transaction: Transaction, ids: list[int]) -> None:
    """Delete the rows whose publish the broker confirmed (in the pass's transaction, committed after)."""
    if ids:
        transaction.execute(schema.delete_outbox(len(ids)), {f"id{i}": row_id for i, row_id in enumerate(ids)})


class Relay:
    """Publishes ``backend``'s outbox through ``publishing`` (the service's confirmed publisher)."""

    def __init__(self, backend: Backend, publishing: ServicePublisher, *, batch_size: int = 100,
                 retry_after_s: float = 30.0) -> None:
        self.backend = backend
        self.publishing = publishing
        self.batch_size = batch_size
        self.retry_after_s = retry_after_s

    def run_once(self) -> int:
        """One pass; return the rows it claimed (published, or marked failed)."""
        transaction = self.backend.begin()
        try:
            _, rows = transaction.execute(schema.claim_outbox(self.backend.dialect),
                                          {"limit": self.batch_size, "now": time.time()})
            if rows:
                self._publish(transaction, rows)
        except BaseException:
            transaction.rollback()
            raise
        transaction.commit()
        return len(rows)

    def _publish(self, transaction: Transaction, rows: list[tuple[Any, ...]]) -> None:
        items = [(exchange, key, Message(bytes(body), **json.loads(properties)))
                 for _id, exchange, key, body, properties in rows]
        errors = self.publishing.publisher.send_many(items)  # BrokerUnavailableError: nothing is deleted
        confirmed = [row[0] for row, error in zip(rows, errors) if error is None]
        for (row_id, *_), (exchange, key, message), error in zip(rows, items, errors):
            self._announce(exchange, key, message, error)
            if error is not None:
                logger.error("kombu-events: outbox row %s (%s, message id %r) was not published: %s; tried again "
                             "in %gs", row_id, key, message.properties.get("message_id"), error, self.retry_after_s)
                transaction.execute(schema.failed_outbox(), {"id": row_id, "error": str(error)[:2000],
                                                             "not_before": time.time() + self.retry_after_s})
        delete_published(transaction, confirmed)

    def _announce(self, exchange: str, key: str, message: Message, error: Exception | None) -> None:
        hooks = self.publishing.hooks
        if hooks.on_after_publish:
            hooks.after_publish(exchange, key, message.properties, error)
        if signals.event_published.receivers:
            signals.event_published.send(sender=self.publishing.sender, exchange=exchange, routing_key=key,
                                         message_id=message.properties.get("message_id"),
                                         properties=message.properties, error=error)


class RelayThread:
    """Relay passes in a daemon thread until :meth:`stop`; also prunes the inbox every ``prune_every_s``.

    ``relay`` None: only the pruning (a service with an inbox and no outbox).
    ``inbox_retention_s`` None or 0: the inbox is never pruned.
    """

    def __init__(self, backend: Backend, relay: Relay | None, *, poll_interval_s: float = 0.2,
                 inbox_retention_s: float | None = None, prune_every_s: float = 60.0,
                 on_pass: Callable[[], None] | None = None) -> None:
        self.backend = backend
        self.relay = relay
        self.poll_interval_s = poll_interval_s
        self.inbox_retention_s = inbox_retention_s
        self.prune_every_s = prune_every_s
        self.on_pass = on_pass
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._next_prune = 0.0

    def start(self) -> None:
        """Start the thread (again, after :meth:`stop`); a running one is left alone."""
        if self._thread is not None and self._thread.is_alive():
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self.run, name=f"kombu-events relay {self.backend.name}", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Ask the thread to stop after its pass, and wait for it up to ``timeout`` seconds."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    def run(self) -> None:
        """The loop (this thread's, or the foreground's in ``kombu-events outbox relay``); never raises."""
        delay = 0.0
        while not self._stop.wait(delay):
            delay = self.step()
        _close_django(self.backend)

    def step(self) -> float:
        """One pass and maybe a prune; return how long to wait before the next."""
        try:
            claimed = self.relay.run_once() if self.relay is not None else 0
            self._maybe_prune()
        except BrokerUnavailableError as exc:
            logger.warning("kombu-events: outbox relay of %s: broker unavailable (%s); trying again in 5s",
                           self.backend.name, exc)
            return 5.0
        except Exception:
            logger.exception("kombu-events: outbox relay of %s failed; trying again in 5s", self.backend.name)
            _close_django(self.backend)  # a connection the database dropped is opened again next time
            return 5.0
        finally:
            if self.on_pass is not None:
                try:
                    self.on_pass()
                except Exception:
                    logger.exception("kombu-events: the relay's on_pass callback failed; ignored")
        full = self.relay is not None and claimed >= self.relay.batch_size
        return 0.0 if full else (self.poll_interval_s if self.relay is not None else self.prune_every_s)

    def _maybe_prune(self) -> None:
        if not self.inbox_retention_s or time.monotonic() < self._next_prune:
            return
        self._next_prune = time.monotonic() + self.prune_every_s
        deleted = inbox.prune(self.backend, older_than_s=self.inbox_retention_s)
        if deleted:
            logger.info("kombu-events: pruned %d inbox rows older than %gs from %s", deleted,
                        self.inbox_retention_s, self.backend.name)


def _close_django(backend: Backend) -> None:
    """Close this thread's Django connection of ``backend`` (nothing for SQLAlchemy, whose pool recycles)."""
    alias = getattr(backend, "alias", None)
    if alias is None:
        return
    try:
        from django.db import connections
        connections[alias].close()
    except Exception:
        logger.debug("kombu-events: closing Django connection %s failed", alias, exc_info=True)
