"""The Celery consumer bootstep behind ``celery worker --with-events-step``."""
from __future__ import annotations

__all__ = ["EventsStep", "install", "OPTION"]

import logging
from typing import Any

import click
from celery import bootsteps

from . import registry, wire_guard
from .consumer import ServiceConsumer

logger = logging.getLogger(__name__)

OPTION = "--with-events-step"


class EventsStep(bootsteps.StartStopStep):
    """Attach event consumers to the worker's connection; inert without ``--with-events-step``."""

    requires = ("celery.worker.consumer.connection:Connection",)
    name = "kombu_events.bootstep.EventsStep"

    def __init__(self, parent: Any, with_events_step: bool = False, **kwargs: Any) -> None:
        super().__init__(parent, **kwargs)
        self.enabled = bool(with_events_step)
        self.consumers: list[ServiceConsumer] = []
        if self.enabled:
            # Resolving here, before the pool forks, validates every setting at start-up, and
            # forked pool processes inherit the routes ready-made.
            services = registry.resolve(parent.app)
            if not services:
                logger.warning("kombu-events: %s given but app %s registers no Events", OPTION, parent.app.main)
            wire_guard.install()  # a message py-amqp cannot decode must not end the worker
            self.consumers = [ServiceConsumer(e) for e in services]

    def start(self, c: Any) -> None:
        """Declare each service's topology and start its consumers."""
        for consumer in self.consumers:
            consumer.start(c.connection, c.pool, c.hub)

    def register_with_event_loop(self, c: Any, hub: Any) -> None:
        """Start receiving: the pool is ready to take work only from here on."""
        for consumer in self.consumers:
            consumer.consume()

    def stop(self, c: Any) -> None:
        """Stop receiving (handlers still running may ack)."""
        for consumer in self.consumers:
            consumer.stop()

    def shutdown(self, c: Any) -> None:
        """Close the step's channels."""
        for consumer in self.consumers:
            consumer.shutdown()


def install(app: Any) -> None:
    """Register the step and the ``--with-events-step`` worker option on ``app`` (once)."""
    if EventsStep not in app.steps["consumer"]:
        app.steps["consumer"].add(EventsStep)
    options = app.user_options["worker"]
    if not any(OPTION in getattr(o, "opts", ()) for o in options):
        options.add(click.Option([OPTION], is_flag=True, default=False,
                                 help="Consume kombu-events handler queues in this worker."))
