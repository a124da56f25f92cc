"""``Schedules``: the periodic schedules of one ``Events`` service.

What was registered with ``@events.periodic``, the handler of each schedule's token
queue (a :class:`~kombu_events.periodic.tokens.TokenHandler`), the seeder that
starts them, and the store their state is read from and written to. The arithmetic
of periods and tokens is pure, in :mod:`kombu_events.core.schedule`.
"""
from __future__ import annotations

__all__ = ["Schedules"]

from datetime import datetime, timedelta
from typing import Any, Callable, TypeVar

from ..broker.declare import declare_queue
from ..core import names
from ..core.config import Settings
from ..core.handlers import Handler, check_runnable
from ..core.schedule import Schedule, make_schedule
from ..core.topology import Topology
from ..errors import ConfigurationError, TopologyMissingError
from .tokens import Seeder, StateStore, TokenHandler

F = TypeVar("F", bound=Callable[[Any], Any])


class Schedules:
    """The schedules of ``service``, in registration order.

    ``settings``, ``broker_url``, ``topology`` (the service's whole topology) and
    ``publish_topology`` (its events exchange and ladder, what a token is addressed
    through) are read on first use. ``app``: the Celery app whose broker settings the store's connection takes.
    """

    def __init__(self, service: str, *, settings: Callable[[], Settings], broker_url: Callable[[], str],
                 topology: Callable[[], Topology], publish_topology: Callable[[], Topology], app: Any = None) -> None:
        self.service = service
        self.app = app
        self._settings = settings
        self._broker_url = broker_url
        self._topology = topology
        self._publish_topology = publish_topology
        self._registered: list[tuple[Schedule, Callable[[Any], Any]]] = []
        self._store: StateStore | None = None

    def register(self, name: str, *, every: float | timedelta, start: datetime | None, catch_up: str,
                 retire_after: float | timedelta | None) -> Callable[[F], F]:
        """Check the schedule now; the decorator it returns checks ``fn`` and adds both."""
        schedule = make_schedule(self.service, name, every=every, start=start, catch_up=catch_up,
                                 retire_after=retire_after)
        if any(s.name == name for s, _fn in self._registered):
            raise ConfigurationError(f"schedule {name!r} is registered twice on service {self.service!r}")

        def decorate(fn: F) -> F:
            check_runnable(fn, role=f"schedule {name!r}: function", argument="an Event", parameter="event")
            self._registered.append((schedule, fn))
            return fn

        return decorate

    @property
    def all(self) -> tuple[Schedule, ...]:
        """The schedules, in registration order."""
        return tuple(schedule for schedule, _fn in self._registered)

    def handlers(self) -> tuple[Handler, ...]:
        """One handler per schedule, of its token queue (checked against the settings)."""
        return tuple(self._handler(schedule, fn) for schedule, fn in self._registered)

    def seeder(self) -> Seeder | None:
        """The middleware that seeds every schedule when the events step starts (None: no schedule)."""
        return Seeder(self) if self._registered else None

    @property
    def store(self) -> StateStore:
        """The schedules' confirmed publisher and state reader (one connection per process, opened on use)."""
        if self._store is None:
            self._store = StateStore(self._broker_url(), self._declare_state_queue, app=self.app)
        return self._store

    @property
    def topology(self) -> Topology:
        """The topology a token's address through the service's ladder is computed from."""
        return self._publish_topology()

    def _handler(self, schedule: Schedule, fn: Callable[[Any], Any]) -> Handler:
        s = self._settings()
        names.validate_name(f"token queue of schedule {schedule.name!r}", schedule.queue, max_bytes=s.max_queue_bytes)
        if schedule.every_ms < s.delay_unit_ms:  # the ladder could not bring the token back in time
            raise ConfigurationError(
                f"every of schedule {schedule.name!r} is {schedule.every_ms} ms, shorter than the ladder's unit "
                f"(delay_unit_ms={s.delay_unit_ms}): lower delay_unit_ms (and raise delay_levels) to run it")
        # Never archived: a token that fails for want of the broker is retried until it goes through.
        return Handler(fn=TokenHandler(self, schedule, fn), name=f"schedule.{schedule.name}", queue=schedule.queue,
                       binding_keys=(), max_retries=10_000, backoff=s.default_backoff, bind=True,
                       prefetch=1, single_active_consumer=True, expires_ms=schedule.retire_after_ms)

    def _declare_state_queue(self, channel: Any, queue: str) -> None:
        if not self._settings().declare:  # the token is retried (not lost) until someone declares it
            raise TopologyMissingError(
                f"the state queue {queue!r} does not exist and this worker does not declare (declare=False): "
                f"run `kombu-events declare` for service {self.service}")
        for entity in self._topology().queues:
            if entity.name == queue:
                declare_queue(channel, entity)
