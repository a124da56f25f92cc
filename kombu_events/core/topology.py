"""The topology of one service as unbound kombu entities (docs/topology.md); no I/O."""
from __future__ import annotations

__all__ = ["Address", "ExchangeBinding", "PartitionSet", "Topology", "build_topology", "NO_DELIVERY_LIMIT",
           "SHARED_ROLES", "TYPE_ARGUMENTS", "archive_segment_bytes", "ARCHIVE_SEGMENT_BYTES"]

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterable, NamedTuple

from kombu import Exchange, Queue, binding

from ..errors import ConfigurationError, DelayTooLongError
from . import ladder, names, ordering
from .config import Settings
from .event_log import EventLog, log_streams
from .handlers import Handler
from .readers import Reader, reader_queues

if TYPE_CHECKING:
    from .schedule import Schedule


#: ``x-delivery-limit`` of every quorum queue: the largest the broker takes, so that it never drops or
#: dead-letters a message for its deliveries (RabbitMQ 4 sets 20 by default; -1 means 0 on 3.10).
#: kombu-events counts redeliveries itself and archives a message redelivered too often (docs/failures.md).
NO_DELIVERY_LIMIT = 2**31 - 1

#: Roles of the queues every service on an exchange declares alike (its delayed-publishing ladder): the first
#: to declare one sets its type, and the others keep it (docs/rabbitmq-versions.md).
SHARED_ROLES = frozenset({"deferred", "unrouted"})

#: The arguments that follow from the queue type; a shared queue may differ in these alone.
TYPE_ARGUMENTS = frozenset({"x-queue-type", "x-quorum-initial-group-size", "x-dead-letter-strategy", "x-overflow",
                            "x-delivery-limit"})


@dataclass(frozen=True)
class ExchangeBinding:
    """``destination`` receives what ``source`` routes with ``routing_key``."""

    destination: Exchange
    source: Exchange
    routing_key: str


@dataclass(frozen=True)
class PartitionSet:
    """An ordered handler's partitions (docs/ordering.md): ``queue``, the handler's queue name, which names
    them; ``exchange``, its consistent-hash exchange; ``sources``, the (exchange, binding key) pairs that feed
    it; ``queues``, its partition queues in order."""

    queue: str
    exchange: str
    sources: tuple[tuple[str, str], ...]
    queues: tuple[Queue, ...]


class Address(NamedTuple):
    """Where to publish a message so that it reaches a queue after a delay."""

    exchange: str
    routing_key: str
    delay_ms: int  # the delay the ladder holds it: whole units, never less than asked


@dataclass(frozen=True)
class Topology:
    """Every exchange, queue (with its bindings) and exchange-to-exchange binding of a service."""

    settings: Settings
    exchanges: tuple[Exchange, ...]
    queues: tuple[Queue, ...]
    exchange_bindings: tuple[ExchangeBinding, ...]
    #: The service's logs of events (``events.log(...)``), whose streams are among ``queues``.
    logs: tuple[EventLog, ...] = ()
    #: The readers of those logs (``@events.reader``), whose two queues each are among ``queues``.
    readers: tuple[Reader, ...] = ()

    @property
    def handler_queues(self) -> tuple[Queue, ...]:
        """The queues handlers consume (a periodic schedule's token queue too)."""
        return tuple(q for q in self.queues if self.role(q.name) in ("handler", "schedule"))

    def role(self, queue: str) -> str:
        """What ``queue`` is for: ``handler``, ``delay`` (the service's ladder), ``archive``,
        ``deferred`` (the events exchange's ladder for delayed publishing), ``unrouted``, ``schedule``
        (a periodic schedule's token queue), ``state`` (its state queue), ``log`` (a log of events' stream) or
        ``reader`` (a reader's lock queue and its position queue)."""
        s = self.settings
        if any(log.queue == queue for log in self.logs):
            return "log"
        if any(queue in (r.queue, r.position_queue) for r in self.readers):
            return "reader"
        if queue == names.archive_name(s.service):
            return "archive"
        if queue.startswith(names.schedule_prefix(s.service)):
            return "state" if queue.endswith(names.STATE_SUFFIX) else "schedule"
        if queue.startswith(names.delay_prefix(s.service)):
            return "delay"
        if s.publish_delay_levels and queue.startswith(names.deferred_exchange(s.exchange) + "."):
            return "deferred"
        if s.publish_delay_levels and queue == names.unrouted_name(s.exchange):
            return "unrouted"
        return "handler"

    def shared(self, queue: str) -> bool:
        """Whether every service on the exchange declares ``queue`` (its delayed-publishing ladder): its
        type is the first declarer's, whichever type this service uses."""
        return self.role(queue) in SHARED_ROLES

    def address(self, queue: str, delay_ms: float) -> Address:
        """Exchange and routing key that bring a message to ``queue`` after ``delay_ms``.

        Raises DelayTooLongError if the ladder cannot hold the delay.
        """
        s = self.settings
        units = ladder.units_for(delay_ms=delay_ms, unit_ms=s.delay_unit_ms, levels=s.delay_levels)
        key = ladder.routing_key(delay_units=units, levels=s.delay_levels, queue=queue)
        return Address(self.entry_exchange(units), key, units * s.delay_unit_ms)

    def publish_address(self, routing_key: str, delay_ms: float) -> Address:
        """Exchange and routing key that deliver an event to every queue bound for ``routing_key``
        after ``delay_ms``, as if it were published then (the events exchange itself for no delay).

        Raises DelayTooLongError if the events exchange's ladder cannot hold the delay.
        """
        s = self.settings
        try:
            units = ladder.units_for(delay_ms=delay_ms, unit_ms=s.publish_delay_unit_ms,
                                     levels=s.publish_delay_levels)
        except DelayTooLongError as exc:
            raise DelayTooLongError(
                f"cannot publish {routing_key!r} with a delay of {delay_ms!r} ms: {s.publish_delay_levels} levels "
                f"of {s.publish_delay_unit_ms} ms hold at most {s.max_publish_delay_ms} ms (settings "
                "publish_delay_levels, publish_delay_unit_ms)") from exc
        if not units:
            return Address(s.exchange, routing_key, 0)
        key = ladder.routing_key(delay_units=units, levels=s.publish_delay_levels, queue=routing_key)
        level = units.bit_length() - 1
        return Address(names.deferred_name(s.exchange, level), key, units * s.publish_delay_unit_ms)

    def entry_exchange(self, delay_units: int) -> str:
        """Exchange to publish a message to for ``delay_units`` (the delivery exchange for 0)."""
        level = ladder.entry_level(delay_units=delay_units)
        if level is None:
            return names.delivery_exchange(self.settings.service)
        return names.delay_name(self.settings.service, level)

    def partition_sets(self) -> list[PartitionSet]:
        """Each ordered handler's partitions: its hash exchange, what feeds it, its partition queues in order."""
        sets: list[PartitionSet] = []
        for exchange in self.exchanges:
            if exchange.type != ordering.HASH_EXCHANGE_TYPE:
                continue
            queues = tuple(q for q in self.queues if any(b.exchange.name == exchange.name for b in q.bindings))
            sources = tuple((link.source.name, link.routing_key) for link in self.exchange_bindings
                            if link.destination.name == exchange.name)
            sets.append(PartitionSet(names.partitioned_queue(exchange.name), exchange.name, sources, queues))
        return sets

    def delivery_key(self, queue: str) -> str:
        """The binding key of ``queue`` on the delivery exchange (what the ladder brings back to it)."""
        return ladder.delivery_pattern(levels=self.settings.delay_levels, queue=queue)

    @property
    def archive_exchange(self) -> str:
        """Exchange of the archive."""
        return names.archive_name(self.settings.service)

    def describe(self) -> list[str]:
        """One line per exchange, queue, argument and binding: the ``declare --dry-run`` plan."""
        lines = [f"exchange {e.name} type={e.type} durable={e.durable}" for e in self.exchanges]
        for queue in self.queues:
            args = " ".join(f"{k}={v}" for k, v in sorted((getattr(queue, "queue_arguments", None) or {}).items()))
            lines.append(f"queue {queue.name} durable={queue.durable} {args}".rstrip())
            # kombu keeps bindings in a set: sorted, the plan reads (and diffs) the same every run.
            for b in sorted(queue.bindings, key=lambda b: (b.exchange.name, b.routing_key or "")):
                lines.append(f"  bind queue {queue.name} <- exchange {b.exchange.name} key={b.routing_key!r}")
        for eb in self.exchange_bindings:
            lines.append(
                f"bind exchange {eb.destination.name} <- exchange {eb.source.name} key={eb.routing_key!r}"
            )
        return lines


def _queue_args(settings: Settings, *, dead_letters: bool) -> dict[str, object]:
    if settings.queue_type != "quorum":
        # Named, not left to the broker: a vhost whose default queue type is quorum (Amazon MQ on
        # RabbitMQ 4) would make a quorum queue without the arguments below, dead-lettering at most once.
        return {"x-queue-type": "classic"}
    args: dict[str, object] = {"x-queue-type": "quorum",
                               "x-quorum-initial-group-size": settings.quorum_initial_group_size,
                               "x-delivery-limit": NO_DELIVERY_LIMIT}
    if dead_letters:
        # Without these a quorum queue dead-letters at most once: a crash loses the message.
        args.update({"x-dead-letter-strategy": "at-least-once", "x-overflow": "reject-publish"})
    return args


def _handler_queue(settings: Settings, handler: Handler, events: Exchange, delivery: Exchange,
                   due: Exchange | None) -> Queue:
    levels = settings.delay_levels
    args = _queue_args(settings, dead_letters=True)
    args.update({
        # A rejected message waits one unit in the ladder (level 0), then comes back here only.
        "x-dead-letter-exchange": names.delay_name(settings.service, 0),
        "x-dead-letter-routing-key": ladder.routing_key(delay_units=1, levels=levels, queue=handler.queue),
    })
    if handler.single_active_consumer:
        args["x-single-active-consumer"] = True
    if handler.expires_ms is not None:
        args["x-expires"] = handler.expires_ms
    if handler.partition_of is not None:  # a partition: what its consistent-hash exchange routes here, weight 1
        bindings = [binding(_hash_exchange(handler), routing_key="1")]
        bindings.append(binding(delivery, routing_key=ladder.delivery_pattern(levels=levels, queue=handler.queue)))
        return Queue(handler.queue, bindings=bindings, durable=True, queue_arguments=args)
    bindings = [binding(events, routing_key=key) for key in handler.binding_keys]
    bindings.append(binding(delivery, routing_key=ladder.delivery_pattern(levels=levels, queue=handler.queue)))
    if due is not None:  # delayed events come due here with one word per level before their own key
        bindings += [binding(due, routing_key=ladder.delivery_pattern(levels=settings.publish_delay_levels,
                                                                      queue=key)) for key in handler.binding_keys]
    return Queue(handler.queue, bindings=bindings, durable=True, queue_arguments=args)


def _partition_exchanges(settings: Settings, handlers: Iterable[Handler], events: Exchange,
                         due: Exchange | None) -> tuple[list[Exchange], list[ExchangeBinding]]:
    """Each ordered handler's consistent-hash exchange, bound to the events exchange with the handler's binding
    keys (and to the due exchange for delayed events), which its partitions are bound to (docs/ordering.md)."""
    exchanges: dict[str, Exchange] = {}
    links: list[ExchangeBinding] = []
    for handler in handlers:
        if handler.partition_of is None or handler.partition_of in exchanges:
            continue
        exchange = exchanges[handler.partition_of] = _hash_exchange(handler)
        links += [ExchangeBinding(exchange, events, key) for key in handler.binding_keys]
        if due is not None:
            links += [ExchangeBinding(exchange, due, ladder.delivery_pattern(levels=settings.publish_delay_levels,
                                                                              queue=key))
                      for key in handler.binding_keys]
    return list(exchanges.values()), links


def _hash_exchange(partition: Handler) -> Exchange:
    """The consistent-hash exchange of an ordered handler's ``partition`` (of any of them: one per handler)."""
    assert partition.partition_of is not None and partition.ordering is not None
    return Exchange(names.partition_exchange(partition.partition_of), ordering.HASH_EXCHANGE_TYPE, durable=True,
                    arguments=partition.ordering.exchange_arguments())


def _ladder(settings: Settings, bottom: Exchange, *, levels: int, unit_ms: int,
            name: Callable[[int], str]) -> tuple[list[Exchange], list[Queue], list[ExchangeBinding]]:
    """Levels ``levels-1 .. 0`` named ``name(level)``, dead-lettering down to ``bottom``."""
    exchanges = [Exchange(name(lv), "topic", durable=True) for lv in range(levels)]
    queues, links = [], []
    for level, exchange in enumerate(exchanges):
        lower = exchanges[level - 1] if level else bottom
        args = _queue_args(settings, dead_letters=True)
        args.update({
            "x-message-ttl": ladder.ttl_ms(level=level, unit_ms=unit_ms),
            "x-dead-letter-exchange": lower.name,
        })
        key = ladder.level_pattern(level=level, levels=levels)
        queues.append(Queue(exchange.name, bindings=[binding(exchange, routing_key=key)],
                            durable=True, queue_arguments=args))
        links.append(ExchangeBinding(lower, exchange, ladder.pass_pattern(level=level, levels=levels)))
    return exchanges[::-1], queues[::-1], links[::-1]


def _archive(settings: Settings) -> tuple[Exchange, Queue]:
    """The archive: a stream, whatever ``queue_type`` (a read never changes it: docs/failures.md), retained by
    age (``archive_ttl_ms``, whole seconds) and size (``archive_max_bytes``), a segment at a time."""
    exchange = Exchange(names.archive_name(settings.service), "fanout", durable=True)
    args: dict[str, object] = {"x-queue-type": "stream"}
    if settings.archive_ttl_ms:
        args["x-max-age"] = f"{-(-settings.archive_ttl_ms // 1000)}s"
    if settings.archive_max_bytes:
        args["x-max-length-bytes"] = settings.archive_max_bytes
    args["x-stream-max-segment-size-bytes"] = archive_segment_bytes(settings.archive_max_bytes)
    return exchange, Queue(exchange.name, bindings=[binding(exchange, routing_key="")],
                           durable=True, queue_arguments=args)


def archive_segment_bytes(max_bytes: int) -> int:
    """Segment size of the archive stream: retention drops whole segments, so a quarter of ``max_bytes``
    (between 1 MiB and 100 MB; 100 MB without a bound)."""
    if not max_bytes:
        return ARCHIVE_SEGMENT_BYTES
    return max(2**20, min(ARCHIVE_SEGMENT_BYTES, max_bytes // 4))


#: Largest segment of the archive stream (RabbitMQ's default is 500 MB).
ARCHIVE_SEGMENT_BYTES = 100_000_000


def _due_exchange(settings: Settings) -> Exchange:
    """Where delayed events come due; what no queue is bound for goes on to ``<exchange>.unrouted``."""
    return Exchange(names.deferred_exchange(settings.exchange), "topic", durable=True,
                    arguments={"alternate-exchange": names.unrouted_name(settings.exchange)})


def _deferred(settings: Settings, due: Exchange) -> tuple[list[Exchange], list[Queue], list[ExchangeBinding]]:
    """The events exchange's own ladder for delayed publishing, its due exchange and unrouted queue.

    Shared by every service on the exchange (each declares it, idempotently; the first to
    declare a queue sets its type, classic or quorum, and the others keep it). A delayed
    event's key is one bit word per level, then its own key; when it comes due, the
    due exchange routes it to every handler queue bound for that key (each binds
    there with one ``*`` per level before its own binding key). An event no queue is
    bound for then goes to the alternate exchange and waits in ``<exchange>.unrouted``.
    """
    exchange = settings.exchange
    unrouted = Exchange(names.unrouted_name(exchange), "fanout", durable=True)
    exchanges, queues, links = _ladder(settings, due, levels=settings.publish_delay_levels,
                                       unit_ms=settings.publish_delay_unit_ms,
                                       name=lambda level: names.deferred_name(exchange, level))
    unrouted_queue = Queue(unrouted.name, bindings=[binding(unrouted, routing_key="")], durable=True,
                           queue_arguments=_queue_args(settings, dead_letters=False))
    return [*exchanges, due, unrouted], [*queues, unrouted_queue], links


def _state_queue(settings: Settings, schedule: Schedule) -> Queue:
    """The one-message queue that holds a schedule's last run: the newest write wins (docs/scheduling.md)."""
    args = _queue_args(settings, dead_letters=False)
    args.update({"x-max-length": 1, "x-overflow": "drop-head", "x-expires": schedule.retire_after_ms})
    return Queue(schedule.state_queue, durable=True, queue_arguments=args)


def build_topology(settings: Settings, handlers: Iterable[Handler], schedules: Iterable[Schedule] = (),
                   logs: Iterable[EventLog] = (), readers: Iterable[Reader] = ()) -> Topology:
    """Build the service's topology: handler queues (a schedule's token queue is one), ladder levels
    N-1..0, delivery, archive, the logs' streams, the schedules' state queues, then the events exchange's
    delayed-publishing ladder (unless ``publish_delay_levels`` is 0)."""
    events = Exchange(settings.exchange, "topic", durable=True)
    delivery = Exchange(names.delivery_exchange(settings.service), "topic", durable=True)
    due = _due_exchange(settings) if settings.publish_delay_levels else None
    shared_exchanges, shared_queues, shared_links = _deferred(settings, due) if due else ([], [], [])
    handlers = tuple(handlers)
    handler_queues = [_handler_queue(settings, h, events, delivery, due) for h in handlers]
    hash_exchanges, hash_links = _partition_exchanges(settings, handlers, events, due)
    level_exchanges, level_queues, links = _ladder(
        settings, delivery, levels=settings.delay_levels, unit_ms=settings.delay_unit_ms,
        name=lambda level: names.delay_name(settings.service, level))
    archive_exchange, archive_queue = _archive(settings)
    state_queues = [_state_queue(settings, schedule) for schedule in schedules]
    logs = tuple(logs)
    streams = log_streams(logs, events, due, settings.publish_delay_levels,
                          taken=[*handler_queues, *level_queues, archive_queue, *state_queues, *shared_queues])
    readers = tuple(readers)
    own = reader_queues(readers)
    taken = {q.name for q in (*handler_queues, *level_queues, archive_queue, *streams, *state_queues, *shared_queues)}
    for queue in own:
        if queue.name in taken:
            raise ConfigurationError(f"the queue {queue.name!r} of a reader has the name of another queue of the "
                                     "service: give the reader (or the handler) another name=")
    return Topology(
        settings=settings,
        exchanges=(events, *hash_exchanges, *level_exchanges, delivery, archive_exchange, *shared_exchanges),
        queues=(*handler_queues, *level_queues, archive_queue, *streams, *own, *state_queues, *shared_queues),
        exchange_bindings=(*hash_links, *links, *shared_links),
        logs=logs,
        readers=readers,
    )
