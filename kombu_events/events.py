"""``Events``: the public surface -- register handlers, publish events, describe the topology."""
from __future__ import annotations

__all__ = ["Events"]

import logging
import os
from datetime import datetime, timedelta
from typing import Any, Callable, Iterable, Literal, Mapping, TypeVar

from . import registry
from .core import names
from .core.backoff import Backoff
from .core.batch import BatchOf
from .core.breaker import CircuitBreaker
from .core.codec import accept_set
from .core.config import Settings, broker_url, check_setting_names, resolve_settings
from .core.contracts import Publication
from .core.handlers import Handler, HandlerSpec, handler_options, partitioned
from .core.health import HealthCheck
from .core.ordering import check_key
from .core.schedule import Schedule
from .core.topology import Topology, build_topology
from .core.wire import ORDER_KEY
from .database import Backend, Inbox, Outbox, backend_for
from .errors import ConfigurationError
from .logbook import LogBook
from .middleware.base import Hooks, Middleware
from .middleware.stack import MiddlewareStack
from .periodic.schedules import Schedules
from .publishing.backlog import Backlog
from .publishing.health import PublisherCheck
from .publishing.published import Published
from .publishing.service import ServicePublisher
from .registry import Route
from .worker.bootstep import install

logger = logging.getLogger(__name__)

F = TypeVar("F", bound=Callable[[Any], Any])


class Events(LogBook):
    """The events of one consuming service on a Celery app.

    ``service`` names every queue and exchange the service owns, so it must be
    unique per consuming service: two services bound to the same key each get
    every event, two workers of one service share them.

    ``backlog`` (a file path, or a :class:`~kombu_events.publishing.backlog.Backlog`) keeps events
    that cannot be published while the broker is away and publishes them, in order,
    once it is back; ``health_checks`` and ``publisher_circuit`` tune when publishing
    goes to the backlog (see docs/publishing.md). Without ``backlog``, nothing changes.

    ``events.publishing`` (a :class:`~kombu_events.publishing.service.ServicePublisher`)
    publishes: its ``publisher`` is the confirmed publisher (a test kit may set its own),
    its ``backlog_publisher`` the backlog's publisher, circuits and flusher.

    ``database`` (``"django"``, ``"django:<alias>"`` or an SQLAlchemy ``Engine``) holds the inbox
    of ``once=True`` handlers; with ``outbox=True``, ``publish`` inside an open transaction of it
    writes the event to its outbox, published after the commit (docs/effectively-once.md).
    """

    def __init__(self, app: Any, service: str, *, broker: str | None = None,
                 middleware: Iterable[Middleware] = (), backlog: str | os.PathLike[str] | Backlog | None = None,
                 health_checks: Iterable[PublisherCheck | Callable[[], Any]] = (),
                 publisher_circuit: CircuitBreaker | None = None, database: Any = None, outbox: bool = False,
                 **settings: Any) -> None:
        names.validate_name("service", service, max_bytes=200)
        check_setting_names(settings)  # a typo fails here, not later at worker start
        self.app = app
        self.service = service
        self._broker = broker
        self._overrides = settings
        self._settings: Settings | None = None
        self._middleware = MiddlewareStack(middleware, self._django_connections)
        self._specs: list[HandlerSpec] = []
        self._handlers: tuple[Handler, ...] | None = None
        self._init_logs()
        self.publishing = ServicePublisher(self, self._middleware.publishing, settings=lambda: self.settings,
                                           broker_url=lambda: self.broker_url, backlog=backlog,
                                           health_checks=health_checks, publisher_circuit=publisher_circuit, app=app)
        self.backlog = self.publishing.backlog
        #: The application's database (``database=``), where the inbox and the outbox live; None without one.
        self.database: Backend | None = backend_for(database) if database is not None else None
        if outbox and self.database is None:
            raise ConfigurationError("outbox=True needs database='django' (or 'django:<alias>') or an SQLAlchemy "
                                     "Engine: the outbox is a table of the application's database")
        #: Where ``publish`` writes inside an open transaction (``outbox=True``); None otherwise.
        self.outbox: Outbox | None = Outbox(self.database, self.publishing) \
            if outbox and self.database is not None else None
        self._inbox: Inbox | None = None
        self._schedules = Schedules(service, settings=lambda: self.settings, broker_url=lambda: self.broker_url,
                                    topology=self.topology, publish_topology=lambda: self.publishing.topology, app=app)
        registry.register(self)
        install(app)

    # -- configuration -------------------------------------------------------------------------

    @property
    def settings(self) -> Settings:
        """Resolved, validated settings (read once, on first use, so Celery config can load first)."""
        if self._settings is None:
            self._settings = resolve_settings(self.service, getattr(self.app, "conf", None), **self._overrides)
        return self._settings

    def never_declare(self) -> None:
        """Act as ``declare=False`` in this process, whatever the settings say (the worker's
        ``--events-no-declare``): the topology is checked, never declared."""
        self._overrides = {**self._overrides, "declare": False}
        self._settings = None

    def _django_connections(self) -> str:
        return self.settings.django_connections

    @property
    def broker_url(self) -> str:
        """Broker for publishing and the CLI: ``broker=``, ``RABBIT_URL``, then the app's ``broker_url``."""
        return broker_url(self.app, self._broker)

    @property
    def accept(self) -> frozenset[str]:
        """Accepted content types."""
        return accept_set(self.settings.accept_content)

    # -- handlers ------------------------------------------------------------------------------

    def handler(
        self,
        *binding_keys: str,
        queue: str | None = None,
        name: str | None = None,
        max_retries: int | None = None,
        backoff: Backoff | None = None,
        retry_for: Any = Exception,
        dont_retry: Any = (),
        bind: bool = False,
        raw: bool = False,
        circuit_breaker: CircuitBreaker | Literal[False] | None = None,
        prefetch: int | None = None,
        single_active_consumer: bool = False,
        type: str | None = None,
        publishers: Iterable[str] | None = None,
        once: bool | Callable[[Any], str] = False,
        concurrency: int | None = None, batch: BatchOf | None = None,
        ordered_by: str | None = None,
        partitions: int | None = None,
        hold_failures: bool = True,
    ) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        """Decorator: call the function for every event whose routing key matches ``binding_keys``.

        The function gets the decoded payload (``raw=True``: the body bytes), or with ``bind=True``
        an :class:`~kombu_events.Event`; a parameter annotated with a type (a pydantic model, a
        dataclass, a ``TypedDict``...) gets a validated instance. Its queue is ``<service>.<name>``
        unless ``queue=`` names it. An ``async def`` function is awaited on an asyncio event loop in
        the pool process (or thread). A function the worker could not run as written is refused here,
        with ConfigurationError: a generator function, a class, one that cannot take one positional
        argument, or an annotation pydantic cannot validate.

        What each option does (retries, circuit breaker, prefetch, ``type``, ``publishers``, ``once``...):
        *Handler options* in the API reference (docs/api.md).
        """
        keys, options = handler_options(
            binding_keys, queue=queue, name=name, max_retries=max_retries, backoff=backoff, retry_for=retry_for,
            dont_retry=dont_retry, bind=bind, raw=raw, circuit_breaker=circuit_breaker, prefetch=prefetch,
            single_active_consumer=single_active_consumer, message_type=type, publishers=publishers, once=once,
            concurrency=concurrency, batch=batch, ordered_by=ordered_by, partitions=partitions,
            hold_failures=hold_failures)
        if once:
            self._add_inbox()

        def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
            self._specs.append(HandlerSpec.of(fn, keys, options))  # refused here, at import time
            self._forget()
            return fn

        return decorate

    @property
    def handlers(self) -> tuple[Handler, ...]:
        """The registered handlers, resolved against the settings (validated, names unique);
        each periodic schedule is one too, of its token queue."""
        if self._handlers is None:
            registered = tuple(partition for spec in self._specs
                               for partition in partitioned(spec.resolve(self.service, self.settings)))
            self._handlers = registered + self._schedules.handlers()
            seen: dict[str, str] = {}
            for h in self._handlers:
                if h.queue in seen:
                    raise ConfigurationError(
                        f"handlers {seen[h.queue]!r} and {h.name!r} both use queue {h.queue!r}; "
                        "give one of them name= or queue=")
                seen[h.queue] = h.name
        return self._handlers

    def _add_inbox(self) -> None:
        """The inbox middleware, once, before the pool forks (registration runs at import time)."""
        if self.database is None:
            raise ConfigurationError("once= needs Events(..., database='django' or an SQLAlchemy Engine): the inbox "
                                     "that drops duplicates is a table of the application's database")
        if self._inbox is None:
            self._inbox = Inbox(self.database, lambda: {h.queue: h.once for h in self.handlers + self.readers
                                                        if h.once})
            self._middleware.add(self._inbox)

    def health_check(self, *handlers: Callable[..., Any], interval_s: float = 10.0,
                     timeout_s: float = 10.0) -> Callable[[Callable[[], Any]], Callable[[], Any]]:
        """Decorator: a function returning ``Healthy``, ``Degraded`` or ``Unhealthy`` for ``handlers``.

        It runs in a thread of the worker every ``interval_s`` and before each
        half-open probe of their circuit breakers (each handler needs one); a run
        that raises, returns anything else or takes over ``timeout_s`` is Unhealthy.
        """

        def decorate(fn: Callable[[], Any]) -> Callable[[], Any]:
            self._middleware.add_check(HealthCheck(fn, handlers, interval_s, timeout_s))
            return fn

        return decorate

    # -- periodic events (docs/scheduling.md) ---------------------------------------------------

    def periodic(self, name: str, *, every: float | timedelta, start: datetime | None = None,
                 catch_up: str = "latest", retire_after: float | timedelta | None = None) -> Callable[[F], F]:
        """Decorator: call ``fn(event)`` once per period of ``every`` (a timedelta or seconds) on some worker.

        ``event.payload`` says which period: ``{"schedule", "period", "due", "missed",
        "missed_count"}``. Periods fall on multiples of ``every`` since ``start`` (a
        datetime; default: the Unix epoch, so an hourly schedule runs on the hour).
        Runs never overlap; a run longer than the period delays the next. After an
        outage, ``catch_up="latest"`` runs once for the latest due period (``missed``
        lists the others), ``"all"`` runs each. A schedule whose workers are all gone
        for ``retire_after`` (default 7 days) is retired: its queues expire. ``fn`` is
        refused like a handler's when the worker could not run it (see :meth:`handler`).
        """
        register = self._schedules.register(name, every=every, start=start, catch_up=catch_up,
                                            retire_after=retire_after)

        def decorate(fn: F) -> F:
            register(fn)
            self._forget()  # the hooks gain the seeder of the schedules
            return fn

        return decorate

    @property
    def schedules(self) -> tuple[Schedule, ...]:
        """The periodic schedules, in registration order."""
        return self._schedules.all

    def add_middleware(self, middleware: Middleware) -> None:
        """Add ``middleware`` after the service's own, for consuming and publishing alike.

        For code that sets a worker up (the events step adds its metrics this way), before
        the pool forks. Circuit breakers and periodic schedules keep their middleware
        objects; this one is appended to what :attr:`hooks` already holds.
        """
        self._middleware.add(middleware)

    @property
    def hooks(self) -> Hooks:
        """The service's middleware, grouped by hook (see :class:`~kombu_events.Middleware`).

        With periodic schedules, their ``Seeder`` (``kombu_events.periodic.tokens``) comes after the
        user's; with circuit breakers, their ``Breakers`` (``kombu_events.middleware.breakers``) comes last.
        """
        return self._middleware.hooks(self.handlers, self._schedules.seeder(),
                                      prefetch_count=lambda: self.prefetch_count,
                                      max_delay_ms=lambda: self.settings.max_delay_ms)

    @property
    def prefetch_count(self) -> int:
        """Messages in flight per handler queue and worker, unless a handler sets its own ``prefetch``:
        the ``prefetch_count`` setting, else 100, lowered for services of many queues (see
        :func:`~kombu_events.core.config.auto_prefetch`)."""
        return self.settings.prefetch_per_queue(len(self.handlers))

    def routes(self) -> list[Route]:
        """What the process running each handler needs: handler, accepted types, middleware."""
        accept, limit = self.accept, self.settings.traceback_limit
        return [Route(h, accept, limit, self.hooks, self.settings.max_body_bytes) for h in self.handlers + self.readers]

    def topology(self) -> Topology:
        """The full topology of this service (unbound kombu entities)."""
        return build_topology(self.settings, self.handlers, self.schedules, self._logs, self._reader_specs())

    # -- publishing (publishing/service.py) -------------------------------------------------------

    def publish(
        self, routing_key: str, payload: Any, *, headers: Mapping[str, Any] | None = None,
        message_id: str | None = None, correlation_id: str | None = None, delay: float = 0, using: Any = None,
        key: str | None = None,
    ) -> Published:
        """Publish one JSON event to the events exchange; return its ``message_id`` (a :class:`Published`).

        Persistent, ``mandatory`` and confirmed: returns once the broker has taken
        it; raises :class:`~kombu_events.errors.UnroutableError` when no queue is bound for
        ``routing_key``, :class:`~kombu_events.errors.PublishError` if the broker refuses it.
        With a backlog, an event the broker cannot take now is stored locally instead:
        the result's ``stored_locally`` is True.

        ``delay`` (seconds): the event waits in the broker (the events exchange's own
        ladder), then goes to every queue bound for ``routing_key`` at that moment, as
        if published then -- never earlier, at most one ``publish_delay_unit_ms`` later.
        One that no queue is bound for when due waits in ``<exchange>.unrouted``. A
        delay beyond the ladder's reach raises :class:`~kombu_events.errors.DelayTooLongError`.

        With ``outbox=True``, inside an open transaction of the service's database (Django: a
        ``transaction.atomic()`` block; SQLAlchemy: the Session or Connection given as ``using=``,
        or a ``once=True`` handler's own) the event is written to the outbox in that transaction
        instead (``stored_locally`` True) and the relay publishes it after the commit.

        ``key``: the key a handler ordered by ``"key"`` orders by (the ``kombu-events-key`` header, which a
        publisher in any language may set instead): events of one key are handled in publish order.
        """
        if key is not None:
            headers = {**(headers or {}), ORDER_KEY: check_key(key)}
        if self.outbox is not None:
            transaction = self.outbox.transaction(using)
            if transaction is not None:
                return self.outbox.write(transaction, routing_key, payload, headers=headers, message_id=message_id,
                                         correlation_id=correlation_id, delay=delay)
        elif using is not None:
            raise ConfigurationError("publish(..., using=...) needs Events(..., database=<Engine>, outbox=True)")
        return self.publishing.publish(routing_key, payload, headers=headers, message_id=message_id,
                                       correlation_id=correlation_id, delay=delay)

    def publish_many(self, events: Iterable[tuple[str, Any]], *, delay: float = 0,
                     using: Any = None) -> list[Published]:
        """Publish ``(routing_key, payload)`` pairs with pipelined confirms; raise on the first failure.

        All are published before any confirm is awaited, so a batch costs about one
        round trip. On error nothing says which of the others arrived: publish the
        batch again (events are at-least-once; handlers are idempotent). ``delay``
        as for :meth:`publish`, the same for every event of the batch. With a backlog,
        events the broker cannot take now are stored locally (``stored_locally``). With
        ``outbox=True`` inside an open transaction, each goes to the outbox as with :meth:`publish`.
        """
        if self.outbox is not None:
            transaction = self.outbox.transaction(using)
            if transaction is not None:
                return [self.outbox.write(transaction, key, payload, delay=delay) for key, payload in events]
        elif using is not None:
            raise ConfigurationError("publish_many(..., using=...) needs Events(..., database=<Engine>, outbox=True)")
        return self.publishing.publish_many(events, delay=delay)

    def event(self, routing_key: str) -> Callable[[Callable[..., Any]], Callable[..., Published]]:
        """Decorator for a publishing function whose body validates its arguments.

        Calling it validates the annotated arguments (InvalidPayload if one does not
        fit), runs the body (which may raise to refuse), then publishes: the body's
        return value if not None, else the call's arguments as a dict.
        """
        return self.publishing.event(routing_key)

    def publishes(self, routing_key_pattern: str, payload_type: Any) -> Publication:
        """Declare that this service sends events matching ``routing_key_pattern`` (a binding
        key, ``*`` and ``#`` allowed) with payloads of ``payload_type``.

        :meth:`publish` then refuses a payload that does not fit, with
        :class:`~kombu_events.errors.InvalidPayload`, before anything is sent; the
        AsyncAPI document (``kombu-events asyncapi``) lists it as a send operation.
        """
        return self.publishing.declare(routing_key_pattern, payload_type)

    @property
    def publications(self) -> tuple[Publication, ...]:
        """What :meth:`publishes` declared, in order."""
        return self.publishing.publications

    def _forget(self) -> None:
        """Handlers, schedules or checks changed: resolve the handlers and build the hooks again on next use."""
        self._handlers = None
        self._forget_readers()
        self._middleware.forget()

    def __repr__(self) -> str:
        return f"<Events service={self.service!r} handlers={len(self._specs)}>"

