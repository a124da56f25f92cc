"""Where RabbitMQ puts a message published into a topology: bindings, alternate exchanges, TTL, dead-lettering.

A pure model of the broker's routing over the unbound kombu entities of
:mod:`kombu_events.core.topology`, for the test stub and for tests. :meth:`BrokerModel.follow`
follows a message from the exchange it is published to, through exchange-to-exchange
bindings (and an exchange's alternate exchange when nothing matches), into every queue
that takes it. A queue nobody consumes that has an ``x-message-ttl`` and an
``x-dead-letter-exchange`` holds the message for the TTL (one TTL per queue, so it
expires in order), then the broker publishes it again to that exchange, with the
queue's ``x-dead-letter-routing-key`` if it has one, else the key it had. It ends in a
consumed queue, in a queue that keeps it (the archive, a stream), or nowhere: RabbitMQ then
drops it without telling anyone, which :attr:`Routed.lost` makes visible. No I/O.
"""
from __future__ import annotations

__all__ = ["BrokerModel", "Landing", "Lost", "Routed", "EXCHANGE_TYPES"]

import logging
import zlib
from typing import Any, Iterable, Mapping, NamedTuple

from kombu import Exchange

from ..core import topic
from ..core.topology import Topology
from ..errors import ConfigurationError, TopologyConflictError

logger = logging.getLogger(__name__)

#: The exchange types the model routes (the ones a topology declares, and ``direct``). ``x-consistent-hash`` (an
#: ordered handler's partitions, docs/ordering.md) sends each message to one of its queues by a hash of the
#: routing key, whatever header or property RabbitMQ's hashes: in the model an event of a key may reach another
#: partition than on the broker, but always exactly one.
EXCHANGE_TYPES = ("topic", "direct", "fanout", "x-consistent-hash")

#: Dead-letter hops after which a message is taken to be going round for ever.
_MAX_HOPS = 256


class Landing(NamedTuple):
    """A copy of the message that ``queue`` holds, delivered ``after_ms`` after the publish."""

    queue: str
    routing_key: str  #: the key it is delivered with: a dead-letter routing key replaces the published one
    after_ms: int  #: the TTLs of the queues it waited in
    waited_in: tuple[str, ...] = ()  #: the queues it expired from on its way, in order


class Lost(NamedTuple):
    """A copy that expired from ``queue`` and that the broker dropped: no queue took it from ``exchange``."""

    queue: str
    exchange: str
    routing_key: str
    after_ms: int
    why: str


class Routed(NamedTuple):
    """What became of one publish."""

    entered: tuple[str, ...]  #: the queues the publish itself reached (none: a mandatory publish is returned)
    landings: tuple[Landing, ...]
    lost: tuple[Lost, ...]


class BrokerModel:
    """The exchanges, queues and bindings of ``topologies`` (merged, as one vhost holds them), routed as RabbitMQ does.

    ``consumed`` names the queues consumers read (default: every topology's handler
    queues): their messages wait for a consumer, they never expire into a dead-letter
    exchange. An entity declared twice with other arguments raises
    TopologyConflictError, as the second declaration would on the broker.
    """

    def __init__(self, topologies: Iterable[Topology], *, consumed: Iterable[str] | None = None) -> None:
        self._exchanges: dict[str, tuple[str, dict[str, Any]]] = {}
        self._queues: dict[str, dict[str, Any]] = {}
        self._bindings: dict[str, list[tuple[str, str, bool]]] = {}  # exchange -> (key, destination, is a queue)
        handler_queues: set[str] = set()
        for topology in topologies:
            for exchange in topology.exchanges:
                self._exchange(exchange)
            for queue in topology.queues:
                # kombu's typing leaves out the attributes of the arguments it was given
                self._queue(queue.name, getattr(queue, "queue_arguments", None))
                for b in queue.bindings:
                    self._exchange(b.exchange)
                    self._bind(b.exchange.name, b.routing_key or "", queue.name, is_queue=True)
            for link in topology.exchange_bindings:
                self._bind(link.source.name, link.routing_key, link.destination.name, is_queue=False)
            handler_queues.update(q.name for q in topology.handler_queues)
        self.consumed = frozenset(handler_queues if consumed is None else consumed)

    # -- declaring -----------------------------------------------------------------------------

    def _exchange(self, exchange: Exchange) -> None:
        name, kind, arguments = exchange.name, exchange.type, getattr(exchange, "arguments", None)
        if kind not in EXCHANGE_TYPES:
            raise ConfigurationError(f"exchange {name!r} is of type {kind!r}: the broker model routes "
                                     f"{', '.join(EXCHANGE_TYPES)} exchanges only")
        declared = (kind, dict(arguments or {}))
        if self._exchanges.setdefault(name, declared) != declared:
            raise TopologyConflictError(f"exchange {name!r} is declared as {self._exchanges[name]} and as {declared}",
                                        entity=name)

    def _queue(self, name: str, arguments: Mapping[str, Any] | None) -> None:
        declared = dict(arguments or {})
        known = self._queues.setdefault(name, declared)
        if known != declared:
            argument = next(k for k in sorted({*known, *declared}) if known.get(k) != declared.get(k))
            raise TopologyConflictError(f"queue {name!r} is declared with {argument}={known.get(argument)!r} and "
                                        f"with {argument}={declared.get(argument)!r}", entity=name, argument=argument)

    def _bind(self, source: str, key: str, destination: str, *, is_queue: bool) -> None:
        bindings = self._bindings.setdefault(source, [])
        if (key, destination, is_queue) not in bindings:  # binding again is a no-op on the broker
            bindings.append((key, destination, is_queue))

    # -- routing -------------------------------------------------------------------------------

    def is_stream(self, name: str) -> bool:
        """Whether the queue ``name`` is a stream (the archive): it keeps every message, read by offset."""
        return self._queues.get(name, {}).get("x-queue-type") == "stream"

    def has_exchange(self, name: str) -> bool:
        """Whether ``name`` is declared (the default exchange ``""`` always is)."""
        return name == "" or name in self._exchanges

    def route(self, exchange: str, routing_key: str) -> tuple[str, ...]:
        """The queues one publish to ``exchange`` with ``routing_key`` reaches, each once, in binding order."""
        if exchange == "":  # the default exchange: the queue named by the key
            return (routing_key,) if routing_key in self._queues else ()
        reached: dict[str, None] = {}
        self._route(exchange, routing_key, reached, set())
        return tuple(reached)

    def _route(self, exchange: str, key: str, reached: dict[str, None], seen: set[str]) -> None:
        if exchange in seen or exchange not in self._exchanges:  # an exchange routes a message once
            return
        seen.add(exchange)
        kind, arguments = self._exchanges[exchange]
        bound = self._bindings.get(exchange, [])
        if kind == "x-consistent-hash":
            matched = [bound[zlib.crc32(key.encode()) % len(bound)][1:]] if bound else []
        else:
            matched = [(dest, is_queue) for pattern, dest, is_queue in bound
                       if kind == "fanout" or (pattern == key if kind == "direct" else topic.matches(pattern, key))]
        if not matched and arguments.get("alternate-exchange"):
            self._route(str(arguments["alternate-exchange"]), key, reached, seen)
        for destination, is_queue in matched:
            if is_queue:
                reached.setdefault(destination)
            else:
                self._route(destination, key, reached, seen)

    def follow(self, exchange: str, routing_key: str) -> Routed:
        """Follow one publish until every copy of it is in a queue that holds it, or lost."""
        entered = self.route(exchange, routing_key)
        landings: list[Landing] = []
        lost: list[Lost] = []
        todo = [Landing(queue, routing_key, 0) for queue in entered]
        while todo:
            here = todo.pop(0)
            args = self._queues.get(here.queue, {})
            ttl, dlx = args.get("x-message-ttl"), args.get("x-dead-letter-exchange")
            if here.queue in self.consumed or ttl is None or dlx is None:
                landings.append(here)
                continue
            key = str(args.get("x-dead-letter-routing-key", here.routing_key))
            after_ms = here.after_ms + int(ttl)
            if here.queue in here.waited_in or len(here.waited_in) >= _MAX_HOPS:
                # RabbitMQ drops a message dead-lettered round a cycle with no rejection on the way.
                lost.append(Lost(here.queue, str(dlx), key, after_ms, "it went round a dead-letter cycle"))
                continue
            reached = self.route(str(dlx), key)
            if not reached:
                why = "no queue is bound for it" if self.has_exchange(str(dlx)) else "the exchange does not exist"
                lost.append(Lost(here.queue, str(dlx), key, after_ms, why))
            todo += [Landing(queue, key, after_ms, (*here.waited_in, here.queue)) for queue in reached]
        return Routed(entered, tuple(landings), tuple(lost))
