"""The process-wide registry: the ``Events`` services of each app and the route of each handler queue.

It sits at the bottom of the package: ``events`` registers services here, the
bootstep finds them here, and the runner in a pool process finds a queue's route
here. The bootstep resolves every route before the pool forks, so forked
processes inherit them ready-made. :class:`EventsService` names what the layers
below ``events`` read of a service, since they may not import ``Events``.
"""
from __future__ import annotations

__all__ = ["Route", "EventsService", "register", "services_of", "resolve", "route", "reset", "services"]

import logging
from dataclasses import dataclass, field
from functools import cached_property, partial
from typing import Any, Callable, Protocol

from .core.codec import MAX_BODY_BYTES, decode
from .core.config import Settings
from .core.handlers import Handler, awaits
from .core.topology import Topology
from .middleware.base import Hooks, Middleware

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Route:
    """What the process that runs a queue's handler needs to know."""

    handler: Handler
    accept: frozenset[str]
    traceback_limit: int
    hooks: Hooks = field(default_factory=Hooks)
    #: The service's ``max_body_bytes``: a compressed body is inflated up to this size, no further.
    max_body_bytes: int = MAX_BODY_BYTES

    @cached_property
    def decode(self) -> Callable[[bytes, str | None, str | None], Any]:
        """``decode(body, content_type, content_encoding)`` with this route's accepted types, made once."""
        return partial(decode, accept=self.accept)

    @cached_property
    def awaits(self) -> bool:
        """Whether the handler is ``async def`` (awaited on the pool's event loop), found once."""
        return awaits(self.handler.fn)


class EventsService(Protocol):
    """An :class:`~kombu_events.Events` service as the layers below ``events`` read it.

    The layers contract (setup.cfg) keeps the registry, the database relay, the integrations,
    the worker and the console from importing ``Events``; they name it by this instead. It
    lives here, beside :class:`Route`, because the registry is the lowest layer that holds
    services. ``Events`` fits it structurally: mypy checks so where ``Events.__init__``
    passes itself to :func:`register`, and tests/unit/test_events_service.py at runtime.
    Members whose types live in layers above this one are typed ``object``.
    """

    @property
    def service(self) -> str:
        """The service's name, the owner of its queues and exchanges."""

    @property
    def app(self) -> Any:
        """The Celery app the service is registered on."""

    @property
    def broker_url(self) -> str:
        """The broker the service publishes to, and the console and the metrics connect to."""

    @property
    def settings(self) -> Settings:
        """The resolved, validated settings."""

    @property
    def handlers(self) -> tuple[Handler, ...]:
        """The registered handlers, periodic schedules' included."""

    @property
    def prefetch_count(self) -> int:
        """Messages in flight per handler queue and worker, unless a handler sets its own."""

    @property
    def hooks(self) -> Hooks:
        """The service's middleware, grouped by hook."""

    @property
    def publishing(self) -> object:
        """The service's publisher (a :class:`~kombu_events.publishing.service.ServicePublisher`)."""

    @property
    def database(self) -> object | None:
        """The ``database=`` backend of the inbox and the outbox (a ``database.Backend``), or None."""

    @property
    def outbox(self) -> object | None:
        """The outbox ``publish`` writes to inside a transaction (``outbox=True``), or None."""

    def topology(self) -> Topology:
        """The service's full topology (unbound kombu entities)."""

    def routes(self) -> list[Route]:
        """The route of each handler queue."""

    def never_declare(self) -> None:
        """Check the topology, never declare it, in this process (``--events-no-declare``)."""

    def add_middleware(self, middleware: Middleware) -> None:
        """Add ``middleware`` after the service's own (before the pool forks)."""


#: Every ``Events`` created in this process, in creation order. ``Any``, not :class:`EventsService`: the
#: layers above ``events`` (``cli``, ``testing``) read what this module hands back as the ``Events`` it is.
services: list[Any] = []
_routes: dict[str, Route] = {}


def register(events: EventsService) -> None:
    """Add an ``Events`` service (called by ``Events.__init__``)."""
    services.append(events)


def services_of(app: Any) -> list[Any]:
    """The services registered on Celery ``app``."""
    return [events for events in services if events.app is app]


def resolve(app: Any) -> list[Any]:
    """Resolve (and so validate) the routes of ``app``'s services now; return the services.

    Raises ConfigurationError for a bad setting or handler: call it at worker start.
    """
    found = services_of(app)
    for events in found:
        for queue_route in events.routes():
            _routes[queue_route.handler.queue] = queue_route
    return found


def route(queue: str) -> Route | None:
    """The route of ``queue``: resolved ones first, else looked up among the services."""
    found = _routes.get(queue)
    if found is not None:
        return found
    for events in services:
        try:
            for queue_route in events.routes():
                _routes.setdefault(queue_route.handler.queue, queue_route)
        except Exception as exc:  # another service's bad configuration is not this message's problem
            logger.debug("kombu-events: skipped service %r while looking up %r: %s", events, queue, exc)
    return _routes.get(queue)


def reset() -> None:
    """Forget every service and route (for tests)."""
    services.clear()
    _routes.clear()
