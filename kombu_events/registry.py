"""The process-wide registry: the ``Events`` services of each app and the route of each handler queue.

It sits at the bottom of the package: ``events`` registers services here, the
bootstep finds them here, and the runner in a pool process finds a queue's route
here. The bootstep resolves every route before the pool forks, so forked
processes inherit them ready-made.
"""
from __future__ import annotations

__all__ = ["Route", "register", "services_of", "resolve", "route", "reset", "services"]

import logging
from dataclasses import dataclass, field
from functools import cached_property, partial
from typing import Any, Callable

from .core.codec import MAX_BODY_BYTES, decode
from .core.handlers import Handler, awaits
from .middleware.base import Hooks

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


#: Every ``Events`` created in this process, in creation order.
services: list[Any] = []
_routes: dict[str, Route] = {}


def register(events: Any) -> None:
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
