"""``Events``: the public surface -- register handlers, publish events, describe the topology."""
from __future__ import annotations

__all__ = ["Events"]

import functools
import inspect
import logging
import os
import threading
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from types import SimpleNamespace
from typing import Any, Callable, Iterable, Literal, Mapping, TypeVar

from . import registry, signals
from .broker.declare import declare_queue
from .core import names
from .core.backoff import Backoff
from .core.circuit import CircuitBreaker
from .core.codec import accept_set
from .core.config import Settings, broker_url, check_setting_names, resolve_settings
from .core.handlers import (
    Handler,
    check_prefetch,
    check_runnable,
    circuit_breaker_of,
    exception_classes,
    validate_binding_key,
)
from .core.health import HealthCheck
from .core.schedule import Schedule, make_schedule
from .core.topology import Topology, build_topology
from .errors import ConfigurationError, KombuEventsError
from .middleware import django_connections
from .middleware.base import Hooks, Middleware
from .middleware.breakers import Breakers
from .periodic.runner import ScheduleRunner, Seeder, StateStore
from .publishing.backlog import Backlog, open_backlog
from .publishing.backlog_policy import Published
from .publishing.buffered import STORED, BacklogPublisher
from .publishing.checks import PublisherCheck, as_check, broker_check
from .publishing.circuits import Guard, publisher_policy
from .publishing.publisher import Publisher, addressed, build_message
from .registry import Route
from .worker.bootstep import install

logger = logging.getLogger(__name__)

F = TypeVar("F", bound=Callable[[Any], Any])


@dataclass
class _Spec:
    fn: Callable[..., Any]
    binding_keys: tuple[str, ...]
    options: dict[str, Any] = field(default_factory=dict)


class Events:
    """The events of one consuming service on a Celery app.

    ``service`` names every queue and exchange the service owns, so it must be
    unique per consuming service: two services bound to the same key each get
    every event, two workers of one service share them.

    ``backlog`` (a file path, or a :class:`~kombu_events.publishing.backlog.Backlog`) keeps events
    that cannot be published while the broker is away and publishes them, in order,
    once it is back; ``health_checks`` and ``publisher_circuit`` tune when publishing
    goes to the backlog (see docs/publishing.md). Without ``backlog``, nothing changes.
    """

    def __init__(self, app: Any, service: str, *, broker: str | None = None,
                 middleware: Iterable[Middleware] = (), backlog: str | os.PathLike[str] | Backlog | None = None,
                 health_checks: Iterable[PublisherCheck | Callable[[], Any]] = (),
                 publisher_circuit: CircuitBreaker | None = None, **settings: Any) -> None:
        names.validate_name("service", service, max_bytes=200)
        check_setting_names(settings)  # a typo fails here, not later at worker start
        self.backlog = open_backlog(backlog)
        self._health_checks = tuple(as_check(c) for c in health_checks)
        self._publisher_circuit = publisher_policy(publisher_circuit, self.backlog is not None, self._health_checks)
        self._backlog_publisher: BacklogPublisher | None = None
        self._backlog_publisher_lock = threading.Lock()
        self.app = app
        self.service = service
        # In a Django project the built-in middleware that tidies database connections around handlers
        # comes after the user's (the circuit breakers, when any, come last: see hooks).
        self._middleware = (*middleware, *django_connections.middleware_for(self._django_connections))
        self._user_hooks = Hooks(self._middleware)  # validates; publishing needs no more
        self._hooks: Hooks | None = None
        self._checks: list[HealthCheck] = []
        self._broker = broker
        self._overrides = settings
        self._settings: Settings | None = None
        self._specs: list[_Spec] = []
        self._handlers: tuple[Handler, ...] | None = None
        self._publisher: Publisher | None = None
        self._publish_topology: Topology | None = None
        self._schedules: list[tuple[Schedule, Callable[[Any], Any]]] = []
        self._schedule_store: StateStore | None = None
        registry.register(self)
        install(app)

    # -- configuration -------------------------------------------------------------------------

    @property
    def settings(self) -> Settings:
        """Resolved, validated settings (read once, on first use, so Celery config can load first)."""
        if self._settings is None:
            self._settings = resolve_settings(self.service, getattr(self.app, "conf", None), **self._overrides)
        return self._settings

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
    ) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        """Decorator: call the function for every event whose routing key matches ``binding_keys``.

        The function gets the decoded payload (``raw=True``: the body bytes), or with
        ``bind=True`` an :class:`~kombu_events.Event`. Its queue is ``<service>.<name>``
        unless ``queue=`` names it. ``circuit_breaker=CircuitBreaker(...)`` pauses its
        queue while it keeps failing (None: the service's ``circuit_breaker`` setting;
        False: none). ``prefetch``: messages of this queue in flight per worker (default:
        the service's ``prefetch_count``); ``single_active_consumer``: only one worker of
        the fleet receives from the queue at a time (with ``prefetch=1``: one message at
        a time, in queue order, across the fleet).

        A function the worker could not run as written is refused here, with
        ConfigurationError: an ``async def`` or generator function (calling it would not
        run its body), a class, or one that cannot take one positional argument.
        """
        if not binding_keys:
            raise ConfigurationError("handler() needs at least one binding key, e.g. 'orders.*.created'")
        keys = tuple(validate_binding_key(k) for k in binding_keys)
        options = {
            "queue": queue, "name": name, "max_retries": max_retries, "backoff": backoff, "bind": bind,
            "raw": raw, "retry_for": exception_classes("retry_for", retry_for),
            "dont_retry": exception_classes("dont_retry", dont_retry),
            "circuit_breaker": circuit_breaker_of(f"handler({', '.join(map(repr, keys))})", circuit_breaker, None),
            "prefetch": check_prefetch(prefetch), "single_active_consumer": bool(single_active_consumer),
        }
        if circuit_breaker is None:
            del options["circuit_breaker"]  # the service's default, read with the settings
        if queue is not None:
            names.validate_name("queue", queue)

        def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
            # Refused here, at import time: the worker acks once the call returns, run or not.
            argument, parameter = _handler_argument(bind=bind, raw=raw)
            check_runnable(fn, role="handler", argument=argument, parameter=parameter)
            if name is None and not isinstance(getattr(fn, "__name__", None), str):
                raise ConfigurationError(f"handler {fn!r} has no __name__ to name its queue after: pass name=")
            self._specs.append(_Spec(fn, keys, options))
            self._handlers = self._hooks = None
            return fn

        return decorate

    @property
    def handlers(self) -> tuple[Handler, ...]:
        """The registered handlers, resolved against the settings (validated, names unique);
        each periodic schedule is one too, of its token queue."""
        if self._handlers is None:
            self._handlers = tuple(self._resolve(spec) for spec in self._specs) + tuple(
                self._schedule_handler(schedule, fn) for schedule, fn in self._schedules)
            seen: dict[str, str] = {}
            for h in self._handlers:
                if h.queue in seen:
                    raise ConfigurationError(
                        f"handlers {seen[h.queue]!r} and {h.name!r} both use queue {h.queue!r}; "
                        "give one of them name= or queue=")
                seen[h.queue] = h.name
        return self._handlers

    def _resolve(self, spec: _Spec) -> Handler:
        s, o = self.settings, spec.options
        name = o["name"] or spec.fn.__name__
        queue = o["queue"] or names.handler_queue(self.service, name)
        names.validate_name(f"queue of handler {name!r}", queue, max_bytes=s.max_queue_bytes)
        reserved = {names.delivery_exchange(self.service), names.archive_name(self.service),
                    names.unrouted_name(s.exchange), names.deferred_exchange(s.exchange)}
        if queue in reserved or queue.startswith((names.delay_prefix(self.service), names.schedule_prefix(self.service),
                                                  names.deferred_exchange(s.exchange) + ".")):
            raise ConfigurationError(f"queue {queue!r} of handler {name!r} collides with the service's own entities")
        for key in spec.binding_keys:
            if len(key.encode("utf-8")) > s.max_binding_key_bytes:
                raise ConfigurationError(
                    f"binding key {key!r} of handler {name!r} is too long: with publish_delay_levels="
                    f"{s.publish_delay_levels} it may be at most {s.max_binding_key_bytes} bytes")
        backoff: Backoff = o["backoff"] or s.default_backoff
        s.check_delay(f"backoff max_delay_ms of handler {name!r}", backoff.max_delay_ms)
        max_retries = s.max_retries if o["max_retries"] is None else o["max_retries"]
        if isinstance(max_retries, bool) or not isinstance(max_retries, int) or not 0 <= max_retries <= 10_000:
            raise ConfigurationError(
                f"max_retries of handler {name!r} must be an integer within 0 .. 10000, got {max_retries!r}")
        return Handler(fn=spec.fn, name=name, queue=queue, binding_keys=spec.binding_keys,
                       max_retries=max_retries, backoff=backoff, retry_for=o["retry_for"],
                       dont_retry=o["dont_retry"], bind=o["bind"], raw=o["raw"],
                       circuit_breaker=o.get("circuit_breaker", s.circuit_breaker), prefetch=o["prefetch"],
                       single_active_consumer=o["single_active_consumer"])

    def health_check(self, *handlers: Callable[..., Any], interval_s: float = 10.0,
                     timeout_s: float = 10.0) -> Callable[[Callable[[], Any]], Callable[[], Any]]:
        """Decorator: a function returning ``Healthy``, ``Degraded`` or ``Unhealthy`` for ``handlers``.

        It runs in a thread of the worker every ``interval_s`` and before each
        half-open probe of their circuit breakers (each handler needs one); a run
        that raises, returns anything else or takes over ``timeout_s`` is Unhealthy.
        """

        def decorate(fn: Callable[[], Any]) -> Callable[[], Any]:
            self._checks.append(HealthCheck(fn, handlers, interval_s, timeout_s))
            self._hooks = None
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
        schedule = make_schedule(self.service, name, every=every, start=start, catch_up=catch_up,
                                 retire_after=retire_after)
        if any(s.name == name for s, _fn in self._schedules):
            raise ConfigurationError(f"schedule {name!r} is registered twice on service {self.service!r}")

        def decorate(fn: F) -> F:
            check_runnable(fn, role=f"schedule {name!r}: function", argument="an Event", parameter="event")
            self._schedules.append((schedule, fn))
            self._handlers = self._hooks = None  # the hooks gain the seeder of the schedules
            return fn

        return decorate

    @property
    def schedules(self) -> tuple[Schedule, ...]:
        """The periodic schedules, in registration order."""
        return tuple(schedule for schedule, _fn in self._schedules)

    def _schedule_handler(self, schedule: Schedule, fn: Callable[[Any], Any]) -> Handler:
        s = self.settings
        names.validate_name(f"token queue of schedule {schedule.name!r}", schedule.queue, max_bytes=s.max_queue_bytes)
        if schedule.every_ms < s.delay_unit_ms:  # the ladder could not bring the token back in time
            raise ConfigurationError(
                f"every of schedule {schedule.name!r} is {schedule.every_ms} ms, shorter than the ladder's unit "
                f"(delay_unit_ms={s.delay_unit_ms}): lower delay_unit_ms (and raise delay_levels) to run it")
        # Never archived: a token that fails for want of the broker is retried until it goes through.
        return Handler(fn=ScheduleRunner(self, schedule, fn), name=f"schedule.{schedule.name}", queue=schedule.queue,
                       binding_keys=(), max_retries=10_000, backoff=s.default_backoff, bind=True,
                       prefetch=1, single_active_consumer=True, expires_ms=schedule.retire_after_ms)

    @property
    def schedule_store(self) -> StateStore:
        """The schedules' confirmed publisher and state reader (one connection per process, opened on use)."""
        if self._schedule_store is None:
            self._schedule_store = StateStore(self.broker_url, self._declare_state_queue)
        return self._schedule_store

    @property
    def schedule_topology(self) -> Topology:
        """The topology a token's address through the service's ladder is computed from."""
        return self._topology_for_publishing()

    def _declare_state_queue(self, channel: Any, queue: str) -> None:
        for entity in self.topology().queues:
            if entity.name == queue:
                declare_queue(channel, entity)

    def add_middleware(self, middleware: Middleware) -> None:
        """Add ``middleware`` after the service's own, for consuming and publishing alike.

        For code that sets a worker up (the events step adds its metrics this way), before
        the pool forks. Circuit breakers and periodic schedules keep their middleware
        objects; this one is appended to what :attr:`hooks` already holds.
        """
        self._user_hooks.add(middleware)  # validates
        self._middleware = (*self._middleware, middleware)
        if self._hooks is not None and self._hooks is not self._user_hooks:
            self._hooks.add(middleware)

    @property
    def hooks(self) -> Hooks:
        """The service's middleware, grouped by hook (see :mod:`kombu_events.middleware.base`).

        With periodic schedules, their :class:`~kombu_events.periodic.runner.Seeder` comes after the
        user's; with circuit breakers, their :class:`~kombu_events.middleware.breakers.Breakers` comes last.
        """
        if self._hooks is None:
            guarded = [h for h in self.handlers if h.circuit_breaker is not None]
            seeder = (Seeder(self),) if self._schedules else ()
            if not guarded and not self._checks:
                self._hooks = Hooks((*self._middleware, *seeder)) if seeder else self._user_hooks
            else:
                breakers = Breakers(guarded, self._checks, prefetch_count=self.prefetch_count,
                                    max_delay_ms=self.settings.max_delay_ms)
                self._hooks = Hooks((*self._middleware, *seeder, breakers))
        return self._hooks

    @property
    def prefetch_count(self) -> int:
        """Messages in flight per handler queue and worker, unless a handler sets its own ``prefetch``:
        the ``prefetch_count`` setting, else 100, lowered for services of many queues (see
        :func:`~kombu_events.core.config.auto_prefetch`)."""
        return self.settings.prefetch_per_queue(len(self.handlers))

    def routes(self) -> list[Route]:
        """What the process running each handler needs: handler, accepted types, middleware."""
        accept, limit = self.accept, self.settings.traceback_limit
        return [Route(h, accept, limit, self.hooks) for h in self.handlers]

    def topology(self) -> Topology:
        """The full topology of this service (unbound kombu entities)."""
        return build_topology(self.settings, self.handlers, self.schedules)

    # -- publishing ----------------------------------------------------------------------------

    @property
    def publisher(self) -> Publisher:
        """The confirmed publisher (one connection per process, opened on first use)."""
        if self._publisher is None:
            self._publisher = Publisher(self.broker_url)
        return self._publisher

    @publisher.setter
    def publisher(self, publisher: Publisher | None) -> None:
        """Publish through ``publisher`` (e.g. the test kit's in-memory one); None: a new one on next use."""
        self._publisher = publisher

    @property
    def backlog_publisher(self) -> BacklogPublisher | None:
        """The backlog's publisher, circuits and flusher (None without ``backlog=``)."""
        if self.backlog is None:
            return None
        with self._backlog_publisher_lock:  # one per Events, even when threads publish their first events at once
            if self._backlog_publisher is None:
                guard = Guard([broker_check(self.broker_url), *self._health_checks], self._publisher_circuit)
                self._backlog_publisher = BacklogPublisher(self.backlog, lambda: self.publisher, guard, on_flushed=self._flushed)
        return self._backlog_publisher

    def publish(
        self, routing_key: str, payload: Any, *, headers: Mapping[str, Any] | None = None,
        message_id: str | None = None, correlation_id: str | None = None, delay: float = 0,
    ) -> Published:
        """Publish one JSON event to the events exchange; return its ``message_id`` (a :class:`Published`).

        Persistent, ``mandatory`` and confirmed: returns once the broker has taken
        it; raises :class:`~kombu_events.UnroutableError` when no queue is bound for
        ``routing_key``, :class:`~kombu_events.PublishError` if the broker refuses it.
        With a backlog, an event the broker cannot take now is stored locally instead:
        the result's ``stored_locally`` is True.

        ``delay`` (seconds): the event waits in the broker (the events exchange's own
        ladder), then goes to every queue bound for ``routing_key`` at that moment, as
        if published then -- never earlier, at most one ``publish_delay_unit_ms`` later.
        One that no queue is bound for when due waits in ``<exchange>.unrouted``. A
        delay beyond the ladder's reach raises :class:`~kombu_events.DelayTooLongError`.
        """
        names.validate_name("routing_key", routing_key)
        exchange, key, message = self._prepared(routing_key, payload, delay, headers=headers,
                                                message_id=message_id, correlation_id=correlation_id)
        return self._send(exchange, key, message)

    def _prepared(self, routing_key: str, payload: Any, delay: float, **options: Any) -> tuple[str, str, Any]:
        """(exchange, routing key, message) for one event: the events exchange, or its ladder for a delay."""
        message = build_message(payload, **options)
        exchange, key = addressed(self._topology_for_publishing(), routing_key, message, delay)
        return exchange, key, message

    def _topology_for_publishing(self) -> Topology:
        if self._publish_topology is None:
            self._publish_topology = build_topology(self.settings, ())
        return self._publish_topology

    def _send(self, exchange: str, routing_key: str, message: Any) -> Published:
        self._before_publish(exchange, routing_key, message)
        if self.backlog_publisher is not None:
            return self._through_backlog([(exchange, routing_key, message)])[0]
        try:
            self.publisher.publish(exchange, routing_key, message)
        except KombuEventsError as exc:
            self._after_publish(exchange, routing_key, message, exc)
            raise
        self._after_publish(exchange, routing_key, message, None)
        return Published(message.properties["message_id"])

    def publish_many(self, events: Iterable[tuple[str, Any]], *, delay: float = 0) -> list[Published]:
        """Publish ``(routing_key, payload)`` pairs with pipelined confirms; raise on the first failure.

        All are published before any confirm is awaited, so a batch costs about one
        round trip. On error nothing says which of the others arrived: publish the
        batch again (events are at-least-once; handlers are idempotent). ``delay``
        as for :meth:`publish`, the same for every event of the batch. With a backlog,
        events the broker cannot take now are stored locally (``stored_locally``).
        """
        items = []
        for routing_key, payload in events:
            names.validate_name("routing_key", routing_key)
            items.append(self._prepared(routing_key, payload, delay))
        for exchange, routing_key, message in items:
            self._before_publish(exchange, routing_key, message)
        return self._through_backlog(items) if self.backlog_publisher is not None else self._publish_many(items)

    def _publish_many(self, items: list[tuple[str, str, Any]]) -> list[Published]:
        """Without a backlog: confirmed, or the first error raised (after every hook ran)."""
        try:
            errors: list[Any] = list(self.publisher.publish_many(items))
        except KombuEventsError as exc:
            errors = [exc] * len(items)
        for (exchange, routing_key, message), error in zip(items, errors):
            self._after_publish(exchange, routing_key, message, error)
        failed = [e for e in errors if e is not None]
        if failed:
            raise failed[0]
        return [Published(m.properties["message_id"]) for _x, _k, m in items]

    def _through_backlog(self, items: list[tuple[str, str, Any]]) -> list[Published]:
        """With a backlog: confirmed, stored locally, or the first error raised (after every hook ran)."""
        assert self._backlog_publisher is not None, "only called once self.backlog_publisher built it"
        outcomes = self._backlog_publisher.publish_or_store(items)
        for (exchange, routing_key, message), outcome in zip(items, outcomes):
            if outcome == STORED:
                self._after_store(exchange, routing_key, message)
            else:
                self._after_publish(exchange, routing_key, message, outcome)  # type: ignore[arg-type]
        failed = [o for o in outcomes if isinstance(o, Exception)]
        if failed:
            raise failed[0]
        return [Published(m.properties["message_id"], stored_locally=o == STORED)
                for (_x, _k, m), o in zip(items, outcomes)]

    def _before_publish(self, exchange: str, routing_key: str, message: Any) -> None:
        if self._user_hooks.on_before_publish:
            self._user_hooks.before_publish(exchange, routing_key, message.properties)

    def _after_publish(self, exchange: str, routing_key: str, message: Any, error: Exception | None) -> None:
        if self._user_hooks.on_after_publish:
            self._user_hooks.after_publish(exchange, routing_key, message.properties, error)
        if signals.event_published.receivers:
            signals.event_published.send(sender=self, exchange=exchange, routing_key=routing_key,
                                         message_id=message.properties.get("message_id"),
                                         properties=message.properties, error=error)

    def _after_store(self, exchange: str, routing_key: str, message: Any) -> None:
        if self._user_hooks.on_after_store:
            self._user_hooks.after_store(exchange, routing_key, message.properties)
        if signals.event_stored.receivers:
            signals.event_stored.send(sender=self, exchange=exchange, routing_key=routing_key,
                                      message_id=message.properties.get("message_id"),
                                      properties=message.properties)

    def _flushed(self, exchange: str, routing_key: str, properties: dict[str, Any], error: Exception | None) -> None:
        """The flusher published a stored event: ``after_publish`` and ``event_published`` see it now."""
        self._after_publish(exchange, routing_key, SimpleNamespace(properties=properties), error)

    def event(self, routing_key: str) -> Callable[[Callable[..., Any]], Callable[..., Published]]:
        """Decorator for a publishing function whose body validates its arguments.

        Calling it runs the body (which may raise to refuse), then publishes: the
        body's return value if not None, else the call's arguments as a dict.
        """
        names.validate_name("routing_key", routing_key)

        def decorate(fn: Callable[..., Any]) -> Callable[..., Published]:
            signature = inspect.signature(fn)

            @functools.wraps(fn)
            def fire(*args: Any, **kwargs: Any) -> Published:
                bound = signature.bind(*args, **kwargs)
                bound.apply_defaults()
                result = fn(*args, **kwargs)
                return self.publish(routing_key, _arguments(signature, bound) if result is None else result)

            fire.routing_key = routing_key  # type: ignore[attr-defined]
            return fire

        return decorate

    def __repr__(self) -> str:
        return f"<Events service={self.service!r} handlers={len(self._specs)}>"


def _handler_argument(*, bind: bool, raw: bool) -> tuple[str, str]:
    """What the worker passes a handler, and the parameter name an error message suggests for it."""
    if bind:
        return "an Event, as bind=True", "event"
    if raw:
        return "the body bytes, as raw=True", "body"
    return "the event's payload", "payload"


def _arguments(signature: inspect.Signature, bound: inspect.BoundArguments) -> dict[str, Any]:
    """The call's arguments as one flat dict (``**kwargs`` merged in, ``*args`` as a list)."""
    payload: dict[str, Any] = {}
    for name, value in bound.arguments.items():
        kind = signature.parameters[name].kind
        if kind is inspect.Parameter.VAR_KEYWORD:
            payload.update(value)
        elif kind is inspect.Parameter.VAR_POSITIONAL:
            payload[name] = list(value)
        else:
            payload[name] = value
    return payload

