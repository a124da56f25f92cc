"""The topology of one service as unbound kombu entities (docs/topology.md); no I/O."""
from __future__ import annotations

__all__ = ["Address", "ExchangeBinding", "Topology", "build_topology"]

from dataclasses import dataclass
from typing import Iterable, NamedTuple

from kombu import Exchange, Queue, binding

from . import ladder, names
from .config import Settings
from .dot import to_dot as render_dot
from .handlers import Handler


@dataclass(frozen=True)
class ExchangeBinding:
    """``destination`` receives what ``source`` routes with ``routing_key``."""

    destination: Exchange
    source: Exchange
    routing_key: str


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

    @property
    def handler_queues(self) -> tuple[Queue, ...]:
        """The queues handlers consume."""
        return self.queues[: len(self.queues) - self.settings.delay_levels - 1]

    def address(self, queue: str, delay_ms: float) -> Address:
        """Exchange and routing key that bring a message to ``queue`` after ``delay_ms``.

        Raises DelayTooLongError if the ladder cannot hold the delay.
        """
        s = self.settings
        units = ladder.units_for(delay_ms=delay_ms, unit_ms=s.delay_unit_ms, levels=s.delay_levels)
        key = ladder.routing_key(delay_units=units, levels=s.delay_levels, queue=queue)
        return Address(self.entry_exchange(units), key, units * s.delay_unit_ms)

    def entry_exchange(self, delay_units: int) -> str:
        """Exchange to publish a message to for ``delay_units`` (the delivery exchange for 0)."""
        level = ladder.entry_level(delay_units=delay_units)
        if level is None:
            return names.delivery_exchange(self.settings.service)
        return names.delay_name(self.settings.service, level)

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

    def to_dot(self) -> str:
        """The topology as a Graphviz ``dot`` graph: the ``declare --dry-run --format dot`` output."""
        return render_dot(self)


def _queue_args(settings: Settings, *, dead_letters: bool) -> dict[str, object]:
    if settings.queue_type != "quorum":
        return {}
    args: dict[str, object] = {"x-queue-type": "quorum"}
    if dead_letters:
        # Without these a quorum queue dead-letters at most once: a crash loses the message.
        args.update({"x-dead-letter-strategy": "at-least-once", "x-overflow": "reject-publish"})
    return args


def _handler_queue(settings: Settings, handler: Handler, events: Exchange, delivery: Exchange) -> Queue:
    levels = settings.delay_levels
    args = _queue_args(settings, dead_letters=True)
    args.update({
        # A rejected message waits one unit in the ladder (level 0), then comes back here only.
        "x-dead-letter-exchange": names.delay_name(settings.service, 0),
        "x-dead-letter-routing-key": ladder.routing_key(delay_units=1, levels=levels, queue=handler.queue),
    })
    bindings = [binding(events, routing_key=key) for key in handler.binding_keys]
    bindings.append(binding(delivery, routing_key=ladder.delivery_pattern(levels=levels, queue=handler.queue)))
    return Queue(handler.queue, bindings=bindings, durable=True, queue_arguments=args)


def _ladder(settings: Settings, delivery: Exchange) -> tuple[list[Exchange], list[Queue], list[ExchangeBinding]]:
    levels, service = settings.delay_levels, settings.service
    exchanges = [Exchange(names.delay_name(service, lv), "topic", durable=True) for lv in range(levels)]
    queues, links = [], []
    for level, exchange in enumerate(exchanges):
        lower = exchanges[level - 1] if level else delivery
        args = _queue_args(settings, dead_letters=True)
        args.update({
            "x-message-ttl": ladder.ttl_ms(level=level, unit_ms=settings.delay_unit_ms),
            "x-dead-letter-exchange": lower.name,
        })
        key = ladder.level_pattern(level=level, levels=levels)
        queues.append(Queue(exchange.name, bindings=[binding(exchange, routing_key=key)],
                            durable=True, queue_arguments=args))
        links.append(ExchangeBinding(lower, exchange, ladder.pass_pattern(level=level, levels=levels)))
    return exchanges[::-1], queues[::-1], links[::-1]


def _archive(settings: Settings) -> tuple[Exchange, Queue]:
    exchange = Exchange(names.archive_name(settings.service), "fanout", durable=True)
    args = _queue_args(settings, dead_letters=False)
    if settings.archive_ttl_ms:
        args["x-message-ttl"] = settings.archive_ttl_ms
    if settings.archive_max_length:
        args["x-max-length"] = settings.archive_max_length
    return exchange, Queue(exchange.name, bindings=[binding(exchange, routing_key="")],
                           durable=True, queue_arguments=args)


def build_topology(settings: Settings, handlers: Iterable[Handler]) -> Topology:
    """Build the service's topology: handler queues, ladder levels N-1..0, delivery, archive."""
    events = Exchange(settings.exchange, "topic", durable=True)
    delivery = Exchange(names.delivery_exchange(settings.service), "topic", durable=True)
    handler_queues = [_handler_queue(settings, h, events, delivery) for h in handlers]
    level_exchanges, level_queues, links = _ladder(settings, delivery)
    archive_exchange, archive_queue = _archive(settings)
    return Topology(
        settings=settings,
        exchanges=(events, *level_exchanges, delivery, archive_exchange),
        queues=(*handler_queues, *level_queues, archive_queue),
        exchange_bindings=tuple(links),
    )
