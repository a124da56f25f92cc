"""``Events``: the public surface -- register handlers, publish events, describe the topology."""
from __future__ import annotations

__all__ = ["Events"]

import functools
import inspect
import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

from . import names, registry, signals
from .backoff import Backoff
from .bootstep import install
from .codec import accept_set
from .config import Settings, broker_url, check_setting_names, resolve_settings
from .errors import ConfigurationError, KombuEventsError
from .handlers import Handler, exception_classes, validate_binding_key
from .middleware import Hooks, Middleware
from .publisher import Publisher, build_message
from .registry import Route
from .topology import Topology, build_topology

logger = logging.getLogger(__name__)


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
    """

    def __init__(self, app: Any, service: str, *, broker: str | None = None,
                 middleware: Iterable[Middleware] = (), **settings: Any) -> None:
        names.validate_name("service", service, max_bytes=200)
        check_setting_names(settings)  # a typo fails here, not later at worker start
        self.app = app
        self.service = service
        #: The service's middleware, grouped by hook (see :mod:`kombu_events.middleware`).
        self.hooks = Hooks(middleware)
        self._broker = broker
        self._overrides = settings
        self._settings: Settings | None = None
        self._specs: list[_Spec] = []
        self._handlers: tuple[Handler, ...] | None = None
        self._publisher: Publisher | None = None
        registry.register(self)
        install(app)

    # -- configuration -------------------------------------------------------------------------

    @property
    def settings(self) -> Settings:
        """Resolved, validated settings (read once, on first use, so Celery config can load first)."""
        if self._settings is None:
            self._settings = resolve_settings(self.service, getattr(self.app, "conf", None), **self._overrides)
        return self._settings

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
    ) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        """Decorator: call the function for every event whose routing key matches ``binding_keys``.

        The function gets the decoded payload (``raw=True``: the body bytes), or with
        ``bind=True`` an :class:`~kombu_events.Event`. Its queue is ``<service>.<name>``
        unless ``queue=`` names it.
        """
        if not binding_keys:
            raise ConfigurationError("handler() needs at least one binding key, e.g. 'orders.*.created'")
        keys = tuple(validate_binding_key(k) for k in binding_keys)
        options = {
            "queue": queue, "name": name, "max_retries": max_retries, "backoff": backoff, "bind": bind,
            "raw": raw, "retry_for": exception_classes("retry_for", retry_for),
            "dont_retry": exception_classes("dont_retry", dont_retry),
        }
        if queue is not None:
            names.validate_name("queue", queue)

        def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
            self._specs.append(_Spec(fn, keys, options))
            self._handlers = None
            return fn

        return decorate

    @property
    def handlers(self) -> tuple[Handler, ...]:
        """The registered handlers, resolved against the settings (validated, names unique)."""
        if self._handlers is None:
            self._handlers = tuple(self._resolve(spec) for spec in self._specs)
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
        reserved = {names.delivery_exchange(self.service), names.archive_name(self.service)}
        if queue in reserved or queue.startswith(names.delay_prefix(self.service)):
            raise ConfigurationError(f"queue {queue!r} of handler {name!r} collides with the service's own entities")
        backoff: Backoff = o["backoff"] or s.default_backoff
        s.check_delay(f"backoff max_delay_ms of handler {name!r}", backoff.max_delay_ms)
        max_retries = s.max_retries if o["max_retries"] is None else o["max_retries"]
        if isinstance(max_retries, bool) or not isinstance(max_retries, int) or not 0 <= max_retries <= 10_000:
            raise ConfigurationError(
                f"max_retries of handler {name!r} must be an integer within 0 .. 10000, got {max_retries!r}")
        return Handler(fn=spec.fn, name=name, queue=queue, binding_keys=spec.binding_keys,
                       max_retries=max_retries, backoff=backoff, retry_for=o["retry_for"],
                       dont_retry=o["dont_retry"], bind=o["bind"], raw=o["raw"])

    def routes(self) -> list[Route]:
        """What the process running each handler needs: handler, accepted types, middleware."""
        accept, limit = self.accept, self.settings.traceback_limit
        return [Route(h, accept, limit, self.hooks) for h in self.handlers]

    def topology(self) -> Topology:
        """The full topology of this service (unbound kombu entities)."""
        return build_topology(self.settings, self.handlers)

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

    def publish(
        self, routing_key: str, payload: Any, *, headers: Mapping[str, Any] | None = None,
        message_id: str | None = None, correlation_id: str | None = None,
    ) -> str:
        """Publish one JSON event to the events exchange; return its ``message_id``.

        Persistent, ``mandatory`` and confirmed: returns once the broker has taken
        it; raises :class:`~kombu_events.UnroutableError` when no queue is bound for
        ``routing_key``, :class:`~kombu_events.PublishError` if the broker refuses it.
        """
        names.validate_name("routing_key", routing_key)
        message = build_message(payload, message_id=message_id, correlation_id=correlation_id, headers=headers)
        exchange = self.settings.exchange
        self._before_publish(exchange, routing_key, message)
        try:
            self.publisher.publish(exchange, routing_key, message)
        except KombuEventsError as exc:
            self._after_publish(exchange, routing_key, message, exc)
            raise
        self._after_publish(exchange, routing_key, message, None)
        return message.properties["message_id"]

    def publish_many(self, events: Iterable[tuple[str, Any]]) -> list[str]:
        """Publish ``(routing_key, payload)`` pairs with pipelined confirms; raise on the first failure.

        All are published before any confirm is awaited, so a batch costs about one
        round trip. On error nothing says which of the others arrived: publish the
        batch again (events are at-least-once; handlers are idempotent).
        """
        exchange = self.settings.exchange
        items = []
        for routing_key, payload in events:
            names.validate_name("routing_key", routing_key)
            items.append((exchange, routing_key, build_message(payload)))
        for _x, routing_key, message in items:
            self._before_publish(exchange, routing_key, message)
        try:
            errors: list[Any] = list(self.publisher.publish_many(items))
        except KombuEventsError as exc:
            errors = [exc] * len(items)
        for (_x, routing_key, message), error in zip(items, errors):
            self._after_publish(exchange, routing_key, message, error)
        failed = [e for e in errors if e is not None]
        if failed:
            raise failed[0]
        return [m.properties["message_id"] for _x, _k, m in items]

    def _before_publish(self, exchange: str, routing_key: str, message: Any) -> None:
        if self.hooks.on_before_publish:
            self.hooks.before_publish(exchange, routing_key, message.properties)

    def _after_publish(self, exchange: str, routing_key: str, message: Any, error: Exception | None) -> None:
        if self.hooks.on_after_publish:
            self.hooks.after_publish(exchange, routing_key, message.properties, error)
        if signals.event_published.receivers:
            signals.event_published.send(sender=self, exchange=exchange, routing_key=routing_key,
                                         message_id=message.properties.get("message_id"),
                                         properties=message.properties, error=error)

    def event(self, routing_key: str) -> Callable[[Callable[..., Any]], Callable[..., str]]:
        """Decorator for a publishing function whose body validates its arguments.

        Calling it runs the body (which may raise to refuse), then publishes: the
        body's return value if not None, else the call's arguments as a dict.
        """
        names.validate_name("routing_key", routing_key)

        def decorate(fn: Callable[..., Any]) -> Callable[..., str]:
            signature = inspect.signature(fn)

            @functools.wraps(fn)
            def fire(*args: Any, **kwargs: Any) -> str:
                bound = signature.bind(*args, **kwargs)
                bound.apply_defaults()
                result = fn(*args, **kwargs)
                return self.publish(routing_key, _arguments(signature, bound) if result is None else result)

            fire.routing_key = routing_key  # type: ignore[attr-defined]
            return fire

        return decorate

    def __repr__(self) -> str:
        return f"<Events service={self.service!r} handlers={len(self._specs)}>"


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
