"""The logs of events a service declares (``events.log``) and their readers (``@events.reader``), as methods of
:class:`~kombu_events.Events` (docs/logs.md): what each was given, checked at import time, and the readers resolved
as handlers of their own against the service's settings."""
from __future__ import annotations

__all__ = ["LogBook"]

from dataclasses import replace
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Callable

from .core.backoff import Backoff
from .core.event_log import EventLog, check_unique, event_log
from .core.handlers import Handler, HandlerSpec, handler_options
from .core.ordering import Ordering, check_hold
from .core.readers import Reader, check_unique as check_unique_reader, reader as make_reader, reader_key
from .errors import ConfigurationError

if TYPE_CHECKING:
    from .core.config import Settings


class LogBook:
    """The part of :class:`~kombu_events.Events` that declares logs and reads them."""

    service: str

    if TYPE_CHECKING:
        @property
        def settings(self) -> Settings: ...

        def _forget(self) -> None: ...

        def _add_inbox(self) -> None: ...

    def _init_logs(self) -> None:
        self._logs: list[EventLog] = []
        self._readers: list[tuple[HandlerSpec, Reader]] = []
        self._reader_handlers: tuple[Handler, ...] | None = None

    def _reader_specs(self) -> tuple[Reader, ...]:
        return tuple(r for _, r in self._readers)

    def _forget_readers(self) -> None:
        self._reader_handlers = None

    def log(self, *binding_keys: str, keep: timedelta | None = None, max_bytes: int | None = None,
            name: str | None = None) -> EventLog:
        """Keep every event of ``binding_keys``, whoever publishes it, in a log: the RabbitMQ stream
        ``<service>.log.<name>``, kept ``keep`` long and/or up to ``max_bytes`` (one at least). ``name``
        defaults to the first key's words (``orders.#``: ``orders``). :meth:`reader` reads it (docs/logs.md)."""
        log = event_log(self.service, binding_keys, keep=keep, max_bytes=max_bytes, name=name)
        check_unique(log, self._logs)
        self._logs.append(log)
        self._forget()  # a new topology (the test stub rebuilds its routing)
        return log

    @property
    def logs(self) -> tuple[EventLog, ...]:
        """The logs :meth:`log` declared, in order."""
        return tuple(self._logs)

    def reader(self, log: EventLog, *, name: str | None = None, start: Any = "first", max_retries: int | None = None,
               backoff: Backoff | None = None, retry_for: Any = Exception, dont_retry: Any = (), bind: bool = False,
               raw: bool = False, once: bool = False) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        """Decorator: call the function for every event of ``log`` (what :meth:`log` returned), in order.

        One worker of the fleet reads at a time, one event in flight, in its pool; it saves its position
        (the queue ``<service>.reader.<name>.position``) so that the next one goes on from there. Without
        a position it starts at ``start``: ``"first"``, ``"last"``, ``"next"`` (only what comes from now),
        an offset, or an aware datetime. A failing event is retried in place with the backoff, then archived;
        the reader goes on after it. The function gets what a handler gets (``bind``, ``raw``; docs/logs.md).
        ``once=True`` (needs ``Events(database=...)``) runs it once per event of the log and rewind, in a
        transaction of the application's database with the inbox row that says so: exactly one effect per event,
        a worker killed or not (docs/effectively-once.md).
        """
        if not isinstance(log, EventLog) or log not in self._logs:
            raise ConfigurationError(f"reader() reads a log of this service: pass what events.log(...) returned, "
                                     f"got {log!r}")
        if not isinstance(once, bool):
            raise ConfigurationError(f"once of a reader must be True or False (its inbox key is the event's offset "
                                     f"and the reader's rewinds), got {once!r}")
        keys, options = handler_options(
            log.binding_keys, queue=None, name=name, max_retries=max_retries, backoff=backoff, retry_for=retry_for,
            dont_retry=dont_retry, bind=bind, raw=raw, circuit_breaker=False, prefetch=1,
            single_active_consumer=False, once=bool(once))
        options["once"] = reader_key if once else False
        if once:
            self._add_inbox()

        def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
            spec = HandlerSpec.of(fn, keys, options)  # refused here, at import time
            if name is None and not isinstance(getattr(fn, "__name__", None), str):
                raise ConfigurationError(f"reader {fn!r} has no __name__ to name it after: pass name=")
            found = make_reader(self.service, log, name=name or fn.__name__, start=start)
            check_unique_reader(found, (r for _, r in self._readers))
            spec.options["queue"] = found.queue
            self._readers.append((spec, found))
            self._forget()
            return fn

        return decorate

    @property
    def readers(self) -> tuple[Handler, ...]:
        """The readers of the service's logs, resolved as handlers: ``queue`` is the reader's lock queue,
        ``reader`` says which log it reads (never among :attr:`handlers`: no queue of theirs is bound)."""
        if self._reader_handlers is None:
            found = []
            for spec, r in self._readers:
                handler = replace(spec.resolve(self.service, self.settings), reader=r, prefetch=1)
                check_hold(handler.name, Ordering("reader", 1), max_retries=handler.max_retries,
                           backoff=handler.backoff)
                found.append(handler)
            self._reader_handlers = tuple(found)
        return self._reader_handlers
