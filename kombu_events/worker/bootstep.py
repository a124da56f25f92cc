"""The Celery consumer bootstep behind ``celery worker --with-events-step [--events-metrics-port PORT]
[--events-no-declare]``."""
from __future__ import annotations

__all__ = ["EventsStep", "install", "OPTION", "METRICS_OPTION", "NO_DECLARE_OPTION"]

import logging
import ssl
import sys
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator, cast

import click
from amqp.exceptions import AccessRefused
from celery import bootsteps
from celery.exceptions import WorkerShutdown

from .. import database, registry
from ..broker import chunked_reads, green_writes, lenient_amqp as wire_guard
from ..broker.connections import tls_options
from ..broker.version import describe
from ..core.config import resolve_metrics_settings
from ..errors import (
    BrokerTooOldError,
    ConfigurationError,
    PartitionsChangedError,
    PluginMissingError,
    TopologyMissingError,
)
from ..integrations import sentry
from ..registry import EventsService
from . import task_queues
from .consumer import ServiceConsumer

_no_exporter = ""  # why the exporter cannot be imported
try:  # prometheus_client is an extra: kombu-events[prometheus]
    from ..integrations import exporter
except ImportError as exc:
    exporter = None  # type: ignore[assignment]
    _no_exporter = str(exc)

logger = logging.getLogger(__name__)

OPTION = "--with-events-step"
METRICS_OPTION = "--events-metrics-port"
NO_DECLARE_OPTION = "--events-no-declare"
#: How often the worker's relay reads its outbox's depth for the metrics.
OUTBOX_READ_S = 5.0


class EventsStep(bootsteps.StartStopStep):
    """Attach event consumers to the worker's connection; inert without ``--with-events-step``."""

    requires = ("celery.worker.consumer.connection:Connection",)
    name = "kombu_events.worker.bootstep.EventsStep"

    def __init__(self, parent: Any, with_events_step: bool = False, events_metrics_port: int | None = None,
                 events_no_declare: bool = False, **kwargs: Any) -> None:
        super().__init__(parent, **kwargs)
        self.enabled = bool(with_events_step)
        self.consumers: list[ServiceConsumer] = []
        self._sentry = False
        self.exporter: Any = None
        self.relays: list[database.RelayThread] = []  # outbox relays and inbox pruning, one per database service
        if not self.enabled and events_metrics_port is not None:
            logger.warning("kombu-events: %s ignored without %s", METRICS_OPTION, OPTION)
        if not self.enabled and events_no_declare:
            logger.warning("kombu-events: %s ignored without %s", NO_DECLARE_OPTION, OPTION)
        if self.enabled:
            if events_no_declare:  # before resolving: the pool's children inherit declare=False
                for events in registry.services_of(parent.app):
                    events.never_declare()
            # Resolving here, before the pool forks, validates every setting at start-up, and
            # forked pool processes inherit the routes ready-made.
            services = registry.resolve(parent.app)
            if not services:
                logger.warning("kombu-events: %s given but app %s registers no Events", OPTION, parent.app.main)
            task_queues.check_task_queues(parent.app, services)  # quorum events need quorum task queues
            wire_guard.install()  # a message py-amqp cannot decode must not end the worker
            _verify_tls(parent.app)  # before Celery's consumer connects
            _retry_channel_errors(parent.app)
            self._sentry = sentry.install()  # handler errors reach Sentry once the app initialised sentry_sdk
            self.exporter = _serve_metrics(parent.app, services, events_metrics_port)
            command = _declare_command(services)
            self.consumers = [ServiceConsumer(e, declare_command=command(e)) for e in services]
            self.relays = [r for r in (database.upkeep(e, on_pass=_outbox_gauges(self, e)) for e in services)
                           if r is not None]

    def include(self, parent: Any) -> bool:
        """Include the step; with it on, Celery's delayed-delivery step (built by now) follows the connection."""
        included: bool = super().include(parent)
        if self.enabled:
            task_queues.follow_connection(parent)
        return included

    def start(self, c: Any) -> None:
        """Declare each service's topology and start its consumers.

        An exception goes on to Celery, named by service here: a connection error makes
        it reconnect and start the step again, any other error stops the worker.
        """
        if self.consumers:  # once per connection: Celery starts the step again on every reconnect
            logger.info("kombu-events: connected to %s", describe(c.connection))
            chunked_reads.install(c.connection, getattr(c, "hub", None))  # fewer recv calls, no frame left unread
        if self.consumers and getattr(c.pool, "is_green", False):  # handlers' greenlets settle on this connection
            green_writes.serialize_writes(c.connection)
        for consumer in self.consumers:
            with _refusing("starting", consumer):
                consumer.start(c.connection, c.pool, c.hub, call_soon=getattr(c, "call_soon", None))
        for relay in self.relays:  # in this (main) process, once: a reconnect leaves a running relay alone
            relay.start()

    def register_with_event_loop(self, c: Any, hub: Any) -> None:
        """Start receiving: the pool is ready to take work only from here on (errors as for :meth:`start`)."""
        for consumer in self.consumers:
            with _refusing("starting to consume", consumer):
                consumer.consume()

    def stop(self, c: Any) -> None:
        """Stop receiving (handlers still running may ack); a service that fails to stop leaves the others to stop."""
        for consumer in self.consumers:
            _logged(consumer.stop, "stopping", consumer)

    def shutdown(self, c: Any) -> None:
        """Close the step's channels."""
        for consumer in self.consumers:
            _logged(consumer.shutdown, "shutting down", consumer)
        if self._sentry:  # a worker in a test's thread ends; the process goes on
            sentry.uninstall()
            self._sentry = False
        for relay in self.relays:
            relay.stop()
        if self.exporter is not None:
            self.exporter.close()
            self.exporter = None


@contextmanager
def _naming(what: str, consumer: ServiceConsumer) -> Iterator[None]:
    """Say which service an error came from, and let it go on to Celery."""
    try:
        yield
    except Exception as exc:
        hint = f"; grant the permissions `{consumer.declare_command[:-len('declare')]}permissions` prints" \
            if isinstance(exc, AccessRefused) else ""
        logger.error("kombu-events: %s service %s failed: %s: %s%s", what, consumer.settings.service,
                     type(exc).__name__, exc, hint)
        raise


def _declare_command(services: list[EventsService]) -> Callable[[EventsService], str]:
    """The command that declares a service's topology, with the worker's ``-A`` module when it has one."""
    app = "APP"
    argv = sys.argv
    for i, arg in enumerate(argv):
        if arg in ("-A", "--app") and i + 1 < len(argv):
            app = argv[i + 1]
        elif arg.startswith("--app="):
            app = arg[len("--app="):]
    several = len(services) > 1
    return lambda events: f"kombu-events -A {app} " + (f"--service {events.service} " if several else "") + "declare"


@contextmanager
def _refusing(what: str, consumer: ServiceConsumer) -> Iterator[None]:
    """As :func:`_naming`; a topology that is not there (declare=False), a permission the broker refuses, a
    broker too old for the service or without a plugin it needs, or partitions of another count on the broker
    stop the worker (exit 1) before it takes a message: Celery would log each with a traceback, and retry a
    refusal (a channel error) for ever."""
    try:
        with _naming(what, consumer):
            yield
    except (TopologyMissingError, AccessRefused, BrokerTooOldError, PluginMissingError,
            PartitionsChangedError) as exc:
        raise WorkerShutdown(1) from exc


def _logged(action: Callable[[], Any], what: str, consumer: ServiceConsumer) -> None:
    """``action()``; an exception is logged with its service (Celery stops or restarts the step regardless)."""
    try:
        action()
    except Exception:
        logger.exception("kombu-events: %s service %s failed; going on with the others", what,
                         consumer.settings.service)


def _retry_channel_errors(app: Any) -> None:
    """Reconnect on a channel error at start-up too (Celery's ``broker_channel_error_retry``), unless the app chose.

    After a connection that went silent, the broker keeps the old connection until its
    heartbeat times out, and with it Celery's exclusive remote-control queue: declaring
    that queue again fails with RESOURCE_LOCKED, a channel error, which by default ends
    the worker. Retrying reconnects once the broker has let the old connection go.
    """
    key = "broker_channel_error_retry"
    maps = getattr(app.conf, "maps", [])
    if any(key in layer for layer in maps[:-1]):  # set by the app (the last layer is Celery's defaults)
        return
    app.conf[key] = True
    logger.debug("kombu-events: %s set to True (the app left it unset)", key)


def _verify_tls(app: Any) -> None:
    """Make the worker's own ``amqps://`` connection (Celery's) verify the broker as kombu-events' connections do.

    Celery passes ``broker_use_ssl`` to kombu as it is, and py-amqp checks the broker's name only when
    ``server_hostname`` is set: set it (and ``cert_reqs``) the way :func:`tls_options` does, in a copy.
    """
    conf = app.conf
    url = conf.get("broker_read_url") or conf.get("broker_url") or ""
    use_ssl = conf.get("broker_use_ssl")
    if not isinstance(url, str) or ";" in url or not url.startswith(("amqps://", "pyamqps://")) \
            or not (use_ssl is None or isinstance(use_ssl, (bool, dict))):  # unset/False: kombu's amqps sets True
        return
    options = tls_options(url, use_ssl)  # logs a WARNING if verification is turned off
    given = use_ssl if isinstance(use_ssl, dict) else {}
    if isinstance(options, dict) and options != given:
        conf.broker_use_ssl = options
        added = {key: value for key, value in options.items() if given.get(key) != value}
        logger.info("kombu-events: the worker's broker connection verifies the broker: broker_use_ssl %s "
                    "added (set them in broker_use_ssl to choose otherwise)",
                    ", ".join(f"{key}=ssl.{value.name}" if isinstance(value, ssl.VerifyMode) else f"{key}={value!r}"
                              for key, value in added.items()))


def _outbox_gauges(step: EventsStep, events: EventsService) -> Callable[[], None] | None:
    """After a relay pass, at most every 5 s: the outbox's depth and oldest row's age for the metrics (when served)."""
    if events.outbox is None:
        return None
    backend = cast(database.Backend, events.database)  # Events sets it: an outbox needs a database
    due = [0.0]

    def update() -> None:
        if step.exporter is None or time.monotonic() < due[0]:
            return
        due[0] = time.monotonic() + OUTBOX_READ_S
        readers = [m for m in events.hooks.middleware if hasattr(m, "outbox_read")]  # the worker's metrics
        if readers:
            found = database.status(backend)
            for reader in readers:
                reader.outbox_read(events.service, found.depth, found.oldest_age_s)

    return update


def _serve_metrics(app: Any, services: list[EventsService], port: int | None) -> Any:
    """The metrics endpoint when a port is set (flag, else ``kombu_events_metrics_port``), else None.

    Served from here, before the pool forks: a port that cannot be bound stops the
    worker at start-up, and /healthz answers (503) until the event loop turns.
    """
    settings = resolve_metrics_settings(app.conf, port=port)
    if settings.port is None:
        return None
    if exporter is None:
        raise ConfigurationError(f"{METRICS_OPTION} / kombu_events_metrics_port need prometheus_client: "
                                 f"pip install 'kombu-events[prometheus]' ({_no_exporter})")
    return exporter.serve_worker(services, settings)


def install(app: Any) -> None:
    """Register the step and the ``--with-events-step`` worker option on ``app`` (once)."""
    if EventsStep not in app.steps["consumer"]:
        app.steps["consumer"].add(EventsStep)
    options = app.user_options["worker"]
    if not any(OPTION in getattr(o, "opts", ()) for o in options):
        options.add(click.Option([OPTION], is_flag=True, default=False,
                                 help="Consume kombu-events handler queues in this worker."))
    if not any(METRICS_OPTION in getattr(o, "opts", ()) for o in options):
        options.add(click.Option([METRICS_OPTION], type=click.IntRange(1, 65_535), default=None,
                                 help="Serve Prometheus /metrics and /healthz on this port "
                                      "(kombu-events[prometheus]; host: kombu_events_metrics_host)."))
    if not any(NO_DECLARE_OPTION in getattr(o, "opts", ()) for o in options):
        options.add(click.Option([NO_DECLARE_OPTION], is_flag=True, default=False,
                                 help="Never declare the events topology: check that `kombu-events declare` "
                                      "created it, and refuse to start if not (the declare=False setting)."))
