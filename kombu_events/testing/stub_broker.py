"""The broker side of the test stub: an app's topology routing its messages, in memory, over a virtual clock.

No broker: every message, published or republished, is routed by its exchange and
routing key through the app's own topology (:mod:`kombu_events.testing.broker_model`:
bindings, the delay ladder's TTLs and dead-lettering), so it lands where RabbitMQ would
put it. A copy that lands in a handler queue waits there until it is due (a copy that
waits out the ladder comes due later on the virtual clock); a copy that lands in
another queue (an exchange's unrouted queue) stays there, and one that lands in a
stream (a service's archive) is appended to it, under its archive key, with the
settlement records that replay and purge append, folded in as every reader of the
archive folds them (:class:`~kombu_events.core.archive_records.Fold`). A mandatory
republish no queue takes is returned, one to a missing exchange refused, as RabbitMQ
would answer the worker; a copy the ladder would drop on its way is recorded in
:attr:`StubBroker.lost`. Nothing sleeps. The worker side, which takes the due copies
and runs their handlers, is :class:`~kombu_events.testing.stub.StubEvents`.
"""
from __future__ import annotations

__all__ = ["StubBroker", "QueuedCopy", "LostCopy"]

import copy
import heapq
import itertools
from typing import Any, Callable, Mapping, NamedTuple

from .. import registry
from ..broker.confirms import RETURNED
from ..core import archive_records, names, wire
from ..core.archive_records import Fold, Settlement
from ..core.topology import Topology
from ..errors import KombuEventsError, PublishError, UnroutableError
from .broker_model import BrokerModel, Lost, Routed
from .records import ArchivedCopy, Pending, SentMessage


class QueuedCopy(NamedTuple):
    """A copy waiting in a handler queue: ordered by when it is due, then by when it was queued."""

    due_ms: float
    seq: int
    delivered_with: str  # the routing key the broker delivers it with (a ladder key for a copy)
    message: Pending


class LostCopy(NamedTuple):
    """A copy of a message that the broker would drop on its way: ``at`` virtual seconds, where and why."""

    at: float
    lost: Lost
    routing_key: str  # the event's own routing key
    message_id: Any


class StubBroker:
    """The in-memory broker of one Celery app: routes publishes, holds the copies that wait, keeps the clock.

    ``topologies`` returns the topologies of every service of the app, the same
    objects while they do not change (the routing model is rebuilt when they do).
    """

    def __init__(self, app: Any, topologies: Callable[[], tuple[Topology, ...]]) -> None:
        self.app = app
        self._topologies = topologies
        #: The virtual clock, in milliseconds since the broker was made.
        self.now_ms = 0.0
        self._seq = itertools.count()
        self._queue: list[QueuedCopy] = []
        self._built: tuple[tuple[Topology, ...], BrokerModel] | None = None
        self._lost_seen = 0
        #: Every message published, in order.
        self.published: list[SentMessage] = []
        #: Every copy the topology would drop on its way (see :meth:`check_lost`).
        self.lost: list[LostCopy] = []
        #: Each stream's records (archived copies, settlements), by queue; a record's offset is its index.
        self.streams: dict[str, list[ArchivedCopy | Settlement]] = {}

    @property
    def now(self) -> float:
        """The virtual clock, in seconds since the broker was made."""
        return self.now_ms / 1000

    @property
    def pending(self) -> list[Pending]:
        """Messages waiting in handler queues, the next due first."""
        return [queued.message for queued in sorted(self._queue)]

    def next_due(self, by_ms: float) -> float | None:
        """When the next waiting copy comes due (ms), if it does by ``by_ms``; else None."""
        if self._queue and self._queue[0].due_ms <= by_ms:
            return self._queue[0].due_ms
        return None

    def take(self) -> QueuedCopy:
        """Take the waiting copy that is due first out of its queue."""
        return heapq.heappop(self._queue)

    def take_due(self, queue: str, by_ms: float, limit: int) -> list[QueuedCopy]:
        """Take up to ``limit`` more copies of ``queue`` due by ``by_ms``, the first due first (a batch)."""
        taken = sorted(q for q in self._queue if q.message.queue == queue and q.due_ms <= by_ms)[:max(0, limit)]
        if taken:
            chosen = set(map(id, taken))
            self._queue = [q for q in self._queue if id(q) not in chosen]
            heapq.heapify(self._queue)
        return taken

    def route(self, exchange: str, routing_key: str, body: bytes, properties: Mapping[str, Any],
              mandatory: bool) -> PublishError | None:
        """Route a publish through the app's topology: a copy for every handler queue it lands in, now or, for
        a delayed publish (to the exchange's own ladder), when it comes due; a delayed one no queue is
        bound for when due waits in the exchange's unrouted queue, and is only recorded."""
        routed = self.model().follow(exchange, routing_key)
        event_exchange, event_key, delay_ms = self._undelayed(exchange, routing_key)
        queues = self.land(routed, event_key, body, properties)
        self.published.append(SentMessage(event_exchange, event_key, body, properties, queues, delay_ms))
        if routed.entered or not mandatory:  # a delayed publish is taken into the ladder: returned never
            return None
        return UnroutableError(f"event {event_key!r} published to exchange {event_exchange!r} was not routed to any "
                               "queue (no handler is bound with a matching key)", exchange=event_exchange,
                               routing_key=event_key)

    def republish(self, exchange: str, routing_key: str | bytes) -> tuple[Routed | None, str | None]:
        """Where the broker routes a mandatory republish, or why it refuses it (as the worker would hear it)."""
        model = self.model()
        key = routing_key.decode("utf-8", "surrogateescape") if isinstance(routing_key, bytes) else routing_key
        if not model.has_exchange(exchange):  # the broker closes the channel: the publish fails
            return None, f"NOT_FOUND - no exchange {exchange!r}"
        routed = model.follow(exchange, key)
        return (routed, None) if routed.entered else (None, RETURNED)

    def _undelayed(self, exchange: str, routing_key: str) -> tuple[str, str, float]:
        """(events exchange, event key, delay in ms) of a message published to an exchange's ladder."""
        for events in registry.services_of(self.app):
            s = events.settings
            if s.publish_delay_levels and exchange.startswith(names.deferred_exchange(s.exchange) + "."):
                words = routing_key.split(".")
                units = int("".join(words[:s.publish_delay_levels]), 2)
                return s.exchange, ".".join(words[s.publish_delay_levels:]), units * s.publish_delay_unit_ms
        return exchange, routing_key, 0.0

    def model(self) -> BrokerModel:
        """The broker model of the topologies of every service of the app (rebuilt when a handler is added)."""
        topologies = self._topologies()
        built = self._built
        if built is None or len(built[0]) != len(topologies) or any(a is not b for a, b in zip(built[0], topologies)):
            built = self._built = (topologies, BrokerModel(topologies))
        return built[1]

    def land(self, routed: Routed, event_key: str, body: bytes, properties: Mapping[str, Any]) -> tuple[str, ...]:
        """Queue a copy for each handler queue ``routed`` lands in (due after the TTLs it waits out); keep what is
        lost. What lands in another queue (the archive, the exchange's unrouted queue) stays there."""
        model = self.model()
        consumed = model.consumed
        landed = tuple(landing for landing in routed.landings if landing.queue in consumed)
        for landing in routed.landings:
            if landing.queue not in consumed and model.is_stream(landing.queue):
                self._append(landing.queue, event_key, body, properties)
        for landing in landed:
            self._push(self.now_ms + landing.after_ms, landing.routing_key,
                       Pending(0.0, landing.queue, event_key, body, copy.deepcopy(dict(properties))))
        self.lost += [LostCopy(self.now + lost.after_ms / 1000, lost, event_key, properties.get("message_id"))
                      for lost in routed.lost]
        return tuple(landing.queue for landing in landed)

    def _append(self, queue: str, event_key: str, body: bytes, properties: Mapping[str, Any]) -> None:
        records = self.streams.setdefault(queue, [])
        kept = copy.deepcopy(dict(properties))
        headers = kept.get("application_headers") or {}
        key = str(headers.get(wire.ARCHIVE_KEY) or f"@{len(records)}")  # as a reader keys a copy without one
        records.append(ArchivedCopy(key, len(records), str(headers.get(wire.ROUTING_KEY, event_key)), body, kept,
                                    self.now))

    def archive(self, queue: str) -> Fold[ArchivedCopy]:
        """The stream ``queue`` folded as a reader folds it: ``pending()`` are the copies no record settled."""
        fold: Fold[ArchivedCopy] = Fold()
        for record in self.streams.get(queue, ()):
            if isinstance(record, Settlement):
                fold.settle(record)
            else:
                fold.add(record.key, record)
        return fold

    def settle(self, queue: str, action: str, keys: list[str], *, by: str | None, note: str = "",
               detail: Mapping[str, str] | None = None) -> None:
        """Append a settlement record for ``keys`` to the stream ``queue``, in the wire format a worker writes."""
        if not keys:  # as ops.archive.settle: a record naming no copy settles nothing
            return
        records = self.streams.setdefault(queue, [])
        body, properties = archive_records.settlement_record(action, keys, by=by, note=note, detail=detail)
        settlement = archive_records.parse_settlement(properties["application_headers"], body, len(records))
        assert settlement is not None
        records.append(settlement)

    def _push(self, due_ms: float, delivered_with: str, message: Pending) -> None:
        queued = QueuedCopy(due_ms, next(self._seq), delivered_with, message._replace(due=due_ms / 1000))
        heapq.heappush(self._queue, queued)

    def check_lost(self) -> None:
        """Raise for a copy lost since the last check: RabbitMQ would drop it, and nobody would know."""
        if len(self.lost) > self._lost_seen:
            dropped = self.lost[self._lost_seen]
            self._lost_seen = len(self.lost)
            lost = dropped.lost
            raise KombuEventsError(
                f"message {dropped.message_id!r} (event {dropped.routing_key!r}) would be lost at t={dropped.at:g} s: "
                f"it expires from queue {lost.queue!r} into exchange {lost.exchange!r} with routing key "
                f"{lost.routing_key!r}, and {lost.why}; RabbitMQ drops it (see stub.lost)")
