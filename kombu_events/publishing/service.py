"""``ServicePublisher``: the publishing side of one ``Events`` service.

It owns the confirmed :class:`~kombu_events.publishing.publisher.Publisher` (one
connection per process, opened on first use), the backlog with its circuits and
flusher when the service has one, and runs the middleware's publishing hooks and the
``event_published`` / ``event_stored`` signals around every publish. ``Events``
registers; this publishes.
"""
from __future__ import annotations

__all__ = ["ServicePublisher"]

import functools
import inspect
import os
import threading
from types import SimpleNamespace
from typing import Any, Callable, Iterable

from .. import signals
from ..core import names, topic
from ..core.breaker import CircuitBreaker
from ..core.config import Settings
from ..core.contracts import Contract, Publication, outgoing, parameter_contracts
from ..core.handlers import validate_binding_key
from ..core.topology import Topology, build_topology
from ..errors import InvalidPayload, KombuEventsError
from ..middleware.base import Hooks
from .backlog import Backlog, open_backlog
from .breakers import PublisherBreakers, publisher_policy
from .buffered import STORED, BacklogPublisher
from .health import PublisherCheck, as_check, broker_check
from .published import Published
from .publisher import Publisher, addressed, build_message

Item = tuple[str, str, Any]  # (exchange, routing key, message)


class ServicePublisher:
    """Publishes the events of one service: to the broker, or into its backlog while the broker is away.

    ``settings`` and ``broker_url`` are read on first use (Celery's config may load
    after the service is declared). ``hooks`` is the service's own middleware (it may
    grow later: ``Events.add_middleware``); ``sender`` is what signals name as sender. ``app``: the
    Celery app whose broker settings (``broker_use_ssl``, ...) every connection takes.
    """

    def __init__(self, sender: Any, hooks: Hooks, *, settings: Callable[[], Settings], broker_url: Callable[[], str],
                 backlog: str | os.PathLike[str] | Backlog | None = None,
                 health_checks: Iterable[PublisherCheck | Callable[[], Any]] = (),
                 publisher_circuit: CircuitBreaker | None = None, app: Any = None) -> None:
        self.sender = sender
        self.app = app
        self.hooks = hooks
        self._settings = settings
        self._broker_url = broker_url
        self.backlog = open_backlog(backlog)
        self._health_checks = tuple(as_check(c) for c in health_checks)
        self._publisher_circuit = publisher_policy(publisher_circuit, self.backlog is not None, self._health_checks)
        self._publisher: Publisher | None = None
        self._backlog_publisher: BacklogPublisher | None = None
        self._backlog_publisher_lock = threading.Lock()
        self._topology: Topology | None = None
        #: What the service declared it sends (``Events.publishes``): ``publish`` checks payloads against them.
        self.publications: tuple[Publication, ...] = ()

    @property
    def publisher(self) -> Publisher:
        """The confirmed publisher (one connection per process, opened on first use)."""
        if self._publisher is None:
            self._publisher = Publisher(self._broker_url(), app=self.app)
        return self._publisher

    @publisher.setter
    def publisher(self, publisher: Publisher | None) -> None:
        """Publish through ``publisher`` (e.g. the test kit's in-memory one); None: a new one on next use."""
        self._publisher = publisher

    @property
    def backlog_publisher(self) -> BacklogPublisher | None:
        """The backlog's publisher, circuits and flusher (None without a backlog)."""
        if self.backlog is None:
            return None
        with self._backlog_publisher_lock:  # one per service, even when threads publish their first events at once
            if self._backlog_publisher is None:
                breakers = PublisherBreakers([broker_check(self._broker_url(), self.app), *self._health_checks],
                              self._publisher_circuit)
                self._backlog_publisher = BacklogPublisher(self.backlog, lambda: self.publisher, breakers,
                                                           on_flushed=self._flushed)
        return self._backlog_publisher

    @property
    def topology(self) -> Topology:
        """The service's topology without handlers: the events exchange and its delay ladder."""
        if self._topology is None:
            self._topology = build_topology(self._settings(), ())
        return self._topology

    def declare(self, pattern: str, payload_type: Any) -> Publication:
        """Declare that events whose key matches ``pattern`` carry ``payload_type``; see ``Events.publishes``."""
        publication = Publication(validate_binding_key(pattern),
                                  Contract(payload_type, where=f"publishes({pattern!r}, ...)"))
        self.publications += (publication,)
        return publication

    def checked(self, routing_key: str, payload: Any) -> Any:
        """``payload`` ready to send: validated against every declared publication its key matches
        (:class:`~kombu_events.errors.InvalidPayload` if it does not fit one), models in JSON mode."""
        ready = None
        for publication in self.publications:
            if topic.matches(publication.pattern, routing_key):
                contract = publication.contract
                dumped = contract.dump(contract.validate(payload))
                ready = dumped if ready is None else ready
        return outgoing(payload) if ready is None else ready

    def publish(self, routing_key: str, payload: Any, *, delay: float = 0, **options: Any) -> Published:
        """Publish one event (``options``: ``headers``, ``message_id``, ``correlation_id``); see ``Events.publish``."""
        names.validate_name("routing_key", routing_key)
        payload = self.checked(routing_key, payload)
        exchange, key, message = self._prepared(routing_key, payload, delay, **options)
        self._before_publish(exchange, key, message)
        if self.backlog_publisher is not None:
            return self._through_backlog([(exchange, key, message)])[0]
        try:
            self.publisher.send(exchange, key, message)
        except KombuEventsError as exc:
            self._after_publish(exchange, key, message, exc)
            raise
        self._after_publish(exchange, key, message, None)
        return Published(message.properties["message_id"])

    def publish_many(self, events: Iterable[tuple[str, Any]], *, delay: float = 0) -> list[Published]:
        """Publish ``(routing_key, payload)`` pairs with pipelined confirms; see ``Events.publish_many``."""
        items = []
        for routing_key, payload in events:
            names.validate_name("routing_key", routing_key)
            items.append(self._prepared(routing_key, self.checked(routing_key, payload), delay))
        for exchange, routing_key, message in items:
            self._before_publish(exchange, routing_key, message)
        return self._through_backlog(items) if self.backlog_publisher is not None else self._publish_many(items)

    def event(self, routing_key: str) -> Callable[[Callable[..., Any]], Callable[..., Published]]:
        """Decorator for a publishing function whose body validates its arguments; see ``Events.event``."""
        names.validate_name("routing_key", routing_key)

        def decorate(fn: Callable[..., Any]) -> Callable[..., Published]:
            signature = inspect.signature(fn)
            contracts = parameter_contracts(fn, where=f"@event({routing_key!r}) {fn.__qualname__}")

            @functools.wraps(fn)
            def fire(*args: Any, **kwargs: Any) -> Published:
                bound = signature.bind(*args, **kwargs)
                bound.apply_defaults()
                if contracts:
                    _validate_arguments(bound, contracts)
                result = fn(*bound.args, **bound.kwargs)
                if result is None:
                    result = _arguments(signature, bound)
                    result.update({name: c.dump(result[name]) for name, c in contracts.items() if name in result})
                return self.publish(routing_key, result)

            fire.routing_key = routing_key  # type: ignore[attr-defined]
            return fire

        return decorate

    def _prepared(self, routing_key: str, payload: Any, delay: float, **options: Any) -> Item:
        """(exchange, routing key, message) for one event: the events exchange, or its ladder for a delay."""
        message = build_message(payload, **options)
        exchange, key = addressed(self.topology, routing_key, message, delay)
        return exchange, key, message

    def _publish_many(self, items: list[Item]) -> list[Published]:
        """Without a backlog: confirmed, or the first error raised (after every hook ran)."""
        try:
            errors: list[Any] = list(self.publisher.send_many(items))
        except KombuEventsError as exc:
            errors = [exc] * len(items)
        for (exchange, routing_key, message), error in zip(items, errors):
            self._after_publish(exchange, routing_key, message, error)
        failed = [e for e in errors if e is not None]
        if failed:
            raise failed[0]
        return [Published(m.properties["message_id"]) for _x, _k, m in items]

    def _through_backlog(self, items: list[Item]) -> list[Published]:
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
        if self.hooks.on_before_publish:
            self.hooks.before_publish(exchange, routing_key, message.properties)

    def _after_publish(self, exchange: str, routing_key: str, message: Any, error: Exception | None) -> None:
        if self.hooks.on_after_publish:
            self.hooks.after_publish(exchange, routing_key, message.properties, error)
        if signals.event_published.receivers:
            signals.event_published.send(sender=self.sender, exchange=exchange, routing_key=routing_key,
                                         message_id=message.properties.get("message_id"),
                                         properties=message.properties, error=error)

    def _after_store(self, exchange: str, routing_key: str, message: Any) -> None:
        if self.hooks.on_after_store:
            self.hooks.after_store(exchange, routing_key, message.properties)
        if signals.event_stored.receivers:
            signals.event_stored.send(sender=self.sender, exchange=exchange, routing_key=routing_key,
                                      message_id=message.properties.get("message_id"),
                                      properties=message.properties)

    def _flushed(self, exchange: str, routing_key: str, properties: dict[str, Any], error: Exception | None) -> None:
        """The flusher published a stored event: ``after_publish`` and ``event_published`` see it now."""
        self._after_publish(exchange, routing_key, SimpleNamespace(properties=properties), error)


def _validate_arguments(bound: inspect.BoundArguments, contracts: dict[str, Contract]) -> None:
    """Replace each annotated argument by its validated value; one InvalidPayload lists every argument's errors."""
    errors: list[tuple[str, str, str]] = []
    for name, contract in contracts.items():
        try:
            bound.arguments[name] = contract.validate(bound.arguments[name])
        except InvalidPayload as exc:
            errors += [(name if path == "(payload)" else f"{name}.{path}", message, given)
                       for path, message, given in exc.errors]
    if errors:
        raise InvalidPayload("the arguments of this event", errors)


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
