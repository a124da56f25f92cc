"""What Prometheus reads at scrape time: the metric families of a
:class:`~kombu_events.integrations.metrics.PrometheusMetrics`'s counts.

A prometheus_client collector: the middleware's hooks add to plain numbers on the
event loop, and a scrape (on the HTTP server's thread) turns them into families.
This module knows the counts only by their shape (:class:`Counts`): the middleware
imports it, never the reverse.
"""
from __future__ import annotations

__all__ = ["Families", "Counts", "HandlerCounts", "BUCKETS", "CIRCUIT_STATES"]

from itertools import accumulate
from typing import Any, Iterator, Mapping, Protocol, Sequence

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString

LABELS = ["service", "queue", "handler"]
#: The labels ``kombu_events_messages`` adds to :data:`LABELS`: ``action`` (what the code calls the step's
#: action), then ``outcome``, the same value under its old name (deprecated: in code an outcome is how an
#: attempt ended, :class:`~kombu_events.Outcome`; removed in a later release).
MESSAGES_LABELS = ["action", "outcome"]
#: Values of the ``state`` label of ``kombu_events_circuit_state``.
CIRCUIT_STATES = ("closed", "open", "half_open")
#: Values of the ``reason`` label of ``kombu_events_unhandled``: the payload does not fit the handler's
#: contract (archived), the body, envelope or headers cannot be read (archived), another message type (acked),
#: a publisher not in the handler's ``publishers=`` (archived).
UNHANDLED_REASONS = ("invalid", "undecodable", "other_type", "publisher")
#: Upper bounds of the handler time buckets, in seconds (1 ms .. 5 min; +Inf is added).
BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
_BOUNDS = [floatToGoString(b) for b in BUCKETS] + ["+Inf"]


class HandlerCounts(Protocol):
    """What was counted for one handler queue (``metrics.QueueStats``), as a scrape reads it."""

    @property
    def labels(self) -> Sequence[str]:
        """service, queue, handler."""

    @property
    def outcomes(self) -> Mapping[str, int]:
        """Messages settled, by the action of the step that settled them (the ``action`` label)."""

    @property
    def buckets(self) -> Sequence[int]:
        """Handler runs per bucket of :data:`BUCKETS` (not cumulative), then +Inf."""

    @property
    def duration_s(self) -> float:
        """The handler's total run time."""

    @property
    def in_flight(self) -> int:
        """Messages received and not settled yet."""

    @property
    def exceptions(self) -> Mapping[str, int]:
        """Exceptions raised by the handler, by type."""

    @property
    def unhandled(self) -> Mapping[str, int]:
        """Messages settled without running the handler, by reason (:data:`UNHANDLED_REASONS`)."""

    @property
    def depth(self) -> int | None:
        """Ready messages in the queue at the last reading; None before the first."""

    @property
    def circuit(self) -> str:
        """The state of the handler's circuit breaker."""


class Counts(Protocol):
    """Every count a scrape reads (``metrics.PrometheusMetrics``'s)."""

    @property
    def queues(self) -> Mapping[str, HandlerCounts]:
        """Each handler queue's counts, by queue name."""

    @property
    def ladder_depths(self) -> Mapping[tuple[str, int], int]:
        """Messages waiting in each level of the delay ladder, by (service, level)."""

    @property
    def archive_depths(self) -> Mapping[str, int]:
        """Copies in the archive (neither replayed nor purged), by service."""

    @property
    def archive_bytes(self) -> Mapping[str, int]:
        """Bytes of every record the archive stream still holds, by service."""

    @property
    def outbox(self) -> Mapping[str, tuple[int, float | None]]:
        """(rows waiting, the oldest one's age in seconds or None) of each service's outbox."""

    @property
    def readers(self) -> Mapping[tuple[str, str], tuple[int, int]]:
        """(position, lag) of each (service, reader) of a log whose position was written."""


class Families:
    """The collector of one ``PrometheusMetrics``'s counts, registered on its registry."""

    def __init__(self, metrics: Counts) -> None:
        self.metrics = metrics

    def describe(self) -> Iterator[Metric]:
        """The families' names, without samples (for the registry's duplicate check)."""
        return iter([*_empty(), *_outbox_families(), _archive_bytes_family(), *_reader_families()])

    def collect(self) -> Iterator[Metric]:
        """Every family, from a snapshot of the counts (the event loop may change them meanwhile)."""
        messages, duration, in_flight, exceptions, queue_depth, ladder, archive, circuit, unhandled = _empty()
        for q in list(self.metrics.queues.values()):
            labels = list(q.labels)
            for action, count in list(q.outcomes.items()):
                messages.add_metric([*labels, action, action], count)  # action, and the deprecated outcome
            duration.add_metric(labels, list(zip(_BOUNDS, accumulate(list(q.buckets)))), q.duration_s)
            in_flight.add_metric(labels, q.in_flight)
            for kind, count in list(q.exceptions.items()):
                exceptions.add_metric([*labels, kind], count)
            for reason, count in list(q.unhandled.items()):
                unhandled.add_metric([*labels, reason], count)
            if q.depth is not None:
                queue_depth.add_metric(labels, q.depth)
            for state in CIRCUIT_STATES if q.circuit in CIRCUIT_STATES else (*CIRCUIT_STATES, q.circuit):
                circuit.add_metric([*labels, state], 1 if state == q.circuit else 0)
        for (service, level), ready in sorted(self.metrics.ladder_depths.items()):
            ladder.add_metric([service, str(level)], ready)
        for service, ready in sorted(self.metrics.archive_depths.items()):
            archive.add_metric([service], ready)
        outbox_depth, outbox_age = _outbox_families()
        for service, (depth, age) in sorted(self.metrics.outbox.items()):
            outbox_depth.add_metric([service], depth)
            outbox_age.add_metric([service], age or 0.0)
        archive_bytes = _archive_bytes_family()
        for service, size in sorted(self.metrics.archive_bytes.items()):
            archive_bytes.add_metric([service], size)
        reader_position, reader_lag = _reader_families()
        for (service, name), (position, lag) in sorted(self.metrics.readers.items()):
            reader_position.add_metric([service, name], position)
            reader_lag.add_metric([service, name], lag)
        return iter([messages, duration, in_flight, exceptions, queue_depth, ladder, archive, circuit, unhandled,
                     outbox_depth, outbox_age, archive_bytes, reader_position, reader_lag])


def _reader_families() -> tuple[GaugeMetricFamily, GaugeMetricFamily]:
    """A log's readers (docs/logs.md): where each is, and how far behind its log's last event."""
    return (
        GaugeMetricFamily("kombu_events_reader_position", "The next offset a reader of a log reads, as its worker "
                          "last wrote it (read by the worker every 15 s).", labels=["service", "reader"]),
        GaugeMetricFamily("kombu_events_reader_lag", "Events of a log after its reader's position (read by the "
                          "worker every 15 s).", labels=["service", "reader"]),
    )


def _archive_bytes_family() -> GaugeMetricFamily:
    return GaugeMetricFamily("kombu_events_archive_bytes", "Bytes of every record the archive stream holds, replayed "
                             "and purged copies too, bodies and headers: what retention by archive_max_bytes counts "
                             "(read by the worker every 15 s).", labels=["service"])


def _outbox_families() -> tuple[GaugeMetricFamily, GaugeMetricFamily]:
    """The outbox's gauges (docs/effectively-once.md), read by the worker's relay every 5 s."""
    return (
        GaugeMetricFamily("kombu_events_outbox_depth", "Committed events waiting in the outbox for the relay "
                          "(read by the worker's relay every 5 s).", labels=["service"]),
        GaugeMetricFamily("kombu_events_outbox_oldest_age_seconds", "How long the oldest event in the outbox has "
                          "waited; 0 when it is empty (read by the worker's relay every 5 s).", labels=["service"]),
    )


def _empty() -> tuple[Any, ...]:
    every_15_s = " (read by the worker every 15 s)"
    return (
        CounterMetricFamily("kombu_events_messages", "Messages settled, by the action of the step that took "
                            "effect (ack, retry, requeue, archive, held); outcome: the same value, deprecated.",
                            labels=[*LABELS, *MESSAGES_LABELS]),
        HistogramMetricFamily("kombu_events_handler_duration_seconds",
                              "The handler's own run time, measured in the pool.", labels=LABELS),
        GaugeMetricFamily("kombu_events_in_flight", "Messages received and not settled yet.", labels=LABELS),
        CounterMetricFamily("kombu_events_handler_exceptions", "Exceptions raised by handlers, by type.",
                            labels=[*LABELS, "exception_type"]),
        GaugeMetricFamily("kombu_events_queue_depth", "Ready messages in a handler queue" + every_15_s,
                          labels=LABELS),
        GaugeMetricFamily("kombu_events_ladder_depth", "Messages waiting in a level of the delay ladder" + every_15_s,
                          labels=["service", "level"]),
        GaugeMetricFamily("kombu_events_archive_depth", "Copies in the archive, neither replayed nor purged"
                          + every_15_s, labels=["service"]),
        GaugeMetricFamily("kombu_events_circuit_state", "1 for the state a handler's circuit breaker is in.",
                          labels=[*LABELS, "state"]),
        CounterMetricFamily("kombu_events_unhandled", "Messages settled without running the handler, by reason: "
                            "invalid (payload does not fit its contract), undecodable, other_type (type= filter), "
                            "publisher (publishers= filter).",
                            labels=[*LABELS, "reason"]),
    )
