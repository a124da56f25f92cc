"""Prometheus metrics of every event message: outcomes, handler time, in flight, exceptions, depths, breakers.

``pip install kombu-events[prometheus]``. A worker started with ``--events-metrics-port``
adds a :class:`PrometheusMetrics` to every service itself and serves it (see
:mod:`kombu_events.integrations.exporter`); a process that only publishes (a web app) registers
one with ``Events(..., middleware=[PrometheusMetrics()])`` and exposes the default
registry as it already does. Messages are settled in the worker's main process, so
their counts live there: the prefork pool needs no multiprocess mode.

Per message, the hooks only add to plain numbers (the event loop's hot path); they
become metric families when Prometheus scrapes (:mod:`kombu_events.integrations.metric_families`).
"""
from __future__ import annotations

__all__ = ["PrometheusMetrics", "QueueStats", "handler_ran", "exception_type", "publish_status", "OUTCOMES",
           "CIRCUIT_STATES", "BUCKETS", "REFRESH_S"]

import itertools
import logging
import threading
import time
from bisect import bisect_left
from functools import partial
from typing import Any, Mapping

from prometheus_client import REGISTRY, CollectorRegistry, Counter

from .. import registry, signals
from ..broker.connections import connected
from ..broker.waits import BrokerSilent, answer_within
from ..core import decision
from ..errors import UnroutableError
from ..middleware.base import Middleware
from ..ops.archive import ArchiveCounter, LegacyArchiveError
from ..ops.log_status import position_of, reader_status
from ..ops.status import DepthTarget, depth_targets, read_depths
from ..registry import EventsService
from .metric_families import BUCKETS, CIRCUIT_STATES, UNHANDLED_REASONS, Families

logger = logging.getLogger(__name__)

_UIDS = itertools.count()

#: Values of the ``outcome`` label: the step that settled the message.
OUTCOMES = ("ack", "retry", "requeue", "archive", "held")
#: Seconds between two depth readings: a scrape never costs a broker round trip.
REFRESH_S = 15.0
_RAN = (decision.OK, decision.FAILED, decision.RETRY)
#: The ``reason`` label of ``kombu_events_unhandled`` for each outcome whose handler did not run.
_UNHANDLED = {decision.INVALID: "invalid", decision.UNDECODABLE: "undecodable", decision.SKIPPED: "other_type",
              decision.REFUSED: "publisher"}


def handler_ran(outcome: decision.Outcome) -> bool:
    """Whether the handler ran for this outcome (and ``duration_ms`` is its time)."""
    return outcome.kind in _RAN or (outcome.kind == decision.ARCHIVE and bool(outcome.exception))


def exception_type(outcome: decision.Outcome) -> str | None:
    """``module.Class`` of the exception the handler raised (or its process died of), else None."""
    if not outcome.exception or not (handler_ran(outcome) or outcome.kind == decision.LOST):
        return None
    return outcome.exception.split(":", 1)[0]


def publish_status(error: Exception | None) -> str:
    """``ok`` once confirmed, ``unroutable`` when no queue was bound, else ``failed``."""
    if error is None:
        return "ok"
    return "unroutable" if isinstance(error, UnroutableError) else "failed"


class QueueStats:
    """What was counted for one handler queue: plain numbers, changed on the event loop only."""

    def __init__(self, labels: tuple[str, str, str]) -> None:
        self.labels = labels  # service, queue, handler
        self.outcomes = dict.fromkeys(OUTCOMES, 0)
        self.buckets = [0] * (len(BUCKETS) + 1)  # per bucket, not cumulative; the last one is +Inf
        self.duration_s = 0.0
        self.exceptions: dict[str, int] = {}
        self.unhandled = dict.fromkeys(UNHANDLED_REASONS, 0)
        self.in_flight = 0
        self.since = float("-inf")  # deliveries received before this (monotonic) belong to an old connection
        self.depth: int | None = None
        self.circuit = "closed"

    def observe(self, seconds: float) -> None:
        """One handler run of ``seconds``."""
        self.buckets[bisect_left(BUCKETS, seconds)] += 1
        self.duration_s += seconds


class PrometheusMetrics(Middleware):
    """Middleware that counts every message of the services it is registered with.

    ``registry``: where the metrics are registered (default: prometheus_client's global
    one; the worker's endpoint uses a registry of its own).
    """

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = REGISTRY if registry is None else registry
        self.queues: dict[str, QueueStats] = {}
        self.ladder_depths: dict[tuple[str, int], int] = {}
        self.archive_depths: dict[str, int] = {}
        self.archive_bytes: dict[str, int] = {}
        self._archive_watches: dict[str, threading.Thread] = {}
        #: (rows waiting, the oldest one's age in seconds or None) of each service's outbox, as its relay last read.
        self.outbox: dict[str, tuple[int, float | None]] = {}
        #: (position, lag) of each (service, reader) of a log, read with the archive's count.
        self.readers: dict[tuple[str, str], tuple[int, int]] = {}
        # Publishing happens in pool processes too: a real Counter, kept in files in multiprocess mode.
        self.published = Counter("kombu_events_published", "Events published with events.publish/publish_many.",
                                 ["exchange", "status"], registry=self.registry)
        self.registry.register(Families(self))
        # Weak: gone with this object. A uid of its own: Celery's dispatcher keys receivers by id(), which a
        # new object may reuse before the dead one's entry is swept (Celery 5.6 then skips the new one).
        signals.circuit_changed.connect(weak=True, dispatch_uid=f"kombu-events-metrics-{next(_UIDS)}")(
            self._circuit_changed)

    # -- hooks (main process) -------------------------------------------------------------------

    def started(self, control: Any) -> None:
        """Zero the in-flight counts of the service's queues; read depths now and every 15 s."""
        now = time.monotonic()
        for queue in control.queues:
            q = self.stats(queue)
            q.in_flight, q.since = 0, now  # what the old connection had in flight can no longer be acked
        events = _service(control.service, control.queues)
        if events is not None:
            targets = [t for t in depth_targets(events.topology()) if t.role != "archive"]
            refresh = partial(self.refresh_depths, control, control.service, targets)
            control.call_after(0, refresh)
            control.call_every(REFRESH_S, refresh)
            self._watch_archive(events)

    def _watch_archive(self, events: EventsService) -> None:
        """Count the service's archive every REFRESH_S in a thread of its own, on a connection of its own: the
        archive is a stream, read (incrementally) rather than peeked, and never on the worker's event loop."""
        service = events.service
        if service in self._archive_watches:
            return
        watch = threading.Thread(target=self._count_archive, args=(events, service), daemon=True,
                                 name=f"kombu-events-archive-depth-{service}")
        self._archive_watches[service] = watch
        watch.start()

    def _count_archive(self, events: EventsService, service: str) -> None:
        counter = ArchiveCounter(events.topology())
        failures = 0
        while True:
            try:
                with connected(events.broker_url, events.app) as conn:
                    while True:
                        self.archive_depths[service] = counter.count(conn)
                        self.archive_bytes[service] = counter.bytes
                        self._read_readers(conn, counter.topology, service)
                        failures = 0
                        time.sleep(REFRESH_S)
            except LegacyArchiveError:
                logger.warning("kombu-events: the archive of service %s is a queue of an earlier version: its depth "
                               "is not exported until `kombu-events migrate --archive` moves it", service)
                return
            except Exception:  # the broker went away, or the archive is not declared yet: again, soon
                failures += 1
                wait_s = min(REFRESH_S, 0.5 * 2 ** (failures - 1))
                logger.log(logging.WARNING if failures > 1 else logging.INFO,
                           "kombu-events: counting the archive of service %s failed; trying again in %g s", service,
                           wait_s, exc_info=failures > 1)
                time.sleep(wait_s)

    def _read_readers(self, conn: Any, topology: Any, service: str) -> None:
        """Each reader's position and lag (its log's last offset read once per log), into the gauges."""
        for log in topology.logs:
            readers = [r for r in topology.readers if r.log.name == log.name]
            if not readers:
                continue
            first, last = position_of(conn, log.queue, wait_s=1.0)
            for reader in readers:
                status = reader_status(conn, reader, last, first)
                if status.position is not None and status.lag is not None:
                    self.readers[(service, reader.name)] = (status.position, status.lag)

    def received(self, delivery: Any) -> None:
        """One more message in flight."""
        (self.queues.get(delivery.queue) or self.stats(delivery.queue)).in_flight += 1

    def settled(self, delivery: Any, outcome: decision.Outcome, step: Any) -> None:
        """Count the outcome, the handler's time and its exception; one message less in flight."""
        q = self.queues.get(delivery.queue) or self.stats(delivery.queue)  # on the hot path: no call if known
        q.outcomes[step.action] = q.outcomes.get(step.action, 0) + 1
        if outcome.kind in _RAN or outcome.exception:
            if handler_ran(outcome):
                q.observe(outcome.duration_ms / 1000.0)
            kind = exception_type(outcome)
            if kind is not None:
                q.exceptions[kind] = q.exceptions.get(kind, 0) + 1
        if outcome.kind in _UNHANDLED:
            q.unhandled[_UNHANDLED[outcome.kind]] += 1
        if delivery.received >= q.since and q.in_flight > 0:
            q.in_flight -= 1

    def after_publish(self, exchange: str, routing_key: str, properties: Mapping[str, Any],
                      error: Exception | None) -> None:
        """Count a published event by exchange and status (in the process that published it)."""
        self.published.labels(exchange, publish_status(error)).inc()

    # -- depths and breakers -------------------------------------------------------------------

    def refresh_depths(self, control: Any, service: str, targets: list[DepthTarget]) -> None:
        """Read every depth with passive declares on the worker's connection (on the event loop)."""
        if control.connection is None:
            return
        try:
            with answer_within(control.connection, doing=f"the depth reads of service {service}"):
                depths = read_depths(control.connection, [t.queue for t in targets])
        except BrokerSilent:
            raise  # from a hub timer: Celery's loop takes it as a lost connection and reconnects
        except Exception:  # the connection went away meanwhile: the gauges keep their last values
            logger.exception("kombu-events: reading the queue depths of service %s failed; trying again in %g s",
                             service, REFRESH_S)
            return
        for target in targets:
            ready = depths.get(target.queue)
            if ready is None:
                continue
            if target.role == "handler":
                self.stats(target.queue).depth = ready
            elif target.role == "delay":
                self.ladder_depths[(service, target.level)] = ready
            else:
                self.archive_depths[service] = ready

    def outbox_read(self, service: str, depth: int, oldest_age_s: float | None) -> None:
        """The relay of ``service`` read its outbox (main process, the relay's thread)."""
        self.outbox[service] = (depth, oldest_age_s)

    def _circuit_changed(self, sender: Any = None, queue: str = "", state: str = "", **kwargs: Any) -> None:
        if queue and state:
            self.stats(queue).circuit = state

    def stats(self, queue: str) -> QueueStats:
        """The counts of ``queue`` (created, labelled by its service and handler, on first sight)."""
        found = self.queues.get(queue)
        if found is None:
            found = self.queues[queue] = QueueStats(_identify(queue))
        return found

    def __repr__(self) -> str:
        return f"<PrometheusMetrics queues={sorted(self.queues)}>"


def _identify(queue: str) -> tuple[str, str, str]:
    """(service, queue, handler name) of a handler queue, from the services of this process."""
    for events in registry.services:
        try:
            handlers = events.handlers
        except Exception as exc:  # another service's bad configuration is not this queue's problem
            logger.debug("kombu-events: skipped %r while labelling %s: %s", events, queue, exc)
            continue
        for handler in handlers:
            if handler.queue == queue:
                return events.service, queue, handler.name
    return "", queue, ""


def _service(service: str, queues: tuple[str, ...]) -> EventsService | None:
    """The ``Events`` named ``service`` whose handler queues are ``queues``, if any."""
    for events in registry.services:
        if events.service == service and tuple(h.queue for h in events.handlers) == tuple(queues):
            return events
    return None
