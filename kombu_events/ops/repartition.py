"""``kombu-events migrate --partitions``: an ordered handler's waiting events moved to a new count of partitions.

A key's partition is its hash among the partitions bound to the handler's consistent-hash exchange ``X``,
so a new count sends many keys to another partition. With the service's workers stopped (a partition,
holding or staging queue with a consumer is refused, as ``migrate --to`` refuses), for each ordered
handler ``Q`` whose partition queues on the broker are not the app's:

1. declare ``Q.repartitioning`` and bind it as ``X`` is bound (events exchange, due exchange); unbind ``X``:
   from now on new events wait there, in the order the broker received them, and the partitions get none;
2. declare the new partitions and bind them to ``X``; unbind the partitions the new count drops, and route
   what the retry ladder brings back to them (``hold_failures=False``) through ``X`` instead;
3. move every event waiting in a partition to ``Q.repartitioning.old``, partition after partition, each
   partition's in the order they wait (its routing key kept in a header): the events of one key all wait
   in one partition, so they stay in order there;
4. send those through ``X``, each to its key's new partition, in order; then the holding queue's, until it
   is empty (or for a minute at most, if events come faster than they go); bind ``X`` back and unbind the
   holding queue, send what came in that instant (counted); delete the two queues and the dropped
   partitions (highest first).

Every move is a copy confirmed before its original is acked: nothing is lost, and an event published while
a binding changes goes to both places (a duplicate, at least once). Each key's order is kept, except for an
event that reached the holding queue in the instant of the switch, after its last emptying: it may run after
a later event of its key; the command reports how many came then. A run that stopped anywhere is finished by
running the command again (each step is idempotent, decided from what the broker holds): nothing is lost,
but the events of a key being moved when it stopped may then run out of order.

:func:`repartition_steps` is pure; :func:`observe` reads the broker and :func:`execute` carries the steps out.
"""
from __future__ import annotations

__all__ = ["RepartitionStep", "Observed", "observe", "repartition_steps", "execute"]

import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from kombu import Queue

from ..broker.declare import QueueCounts, close_quietly, peek_queues
from ..broker.partitions import existing_partitions
from ..core import names
from ..core.topology import PartitionSet, Topology
from .migrate import MigrationError, copy_properties, transfer

logger = logging.getLogger(__name__)

_DELETE_TRIES = 5
#: A staged event's routing key (the staging queue's copy was published to it by name).
ROUTING_KEY = "x-kombu-events-routing-key"
_DRAIN_S = 60.0  # emptying the holding queue before the switch, however fast events come: at most this long
_SAY = {
    "declare-holding": "declare {queue} (holds the new events meanwhile)",
    "hold": "bind {queue} as the hash exchange is bound: new events wait there",
    "unhook": "unbind the hash exchange {queue}: the partitions get no new event",
    "declare": "declare partition {queue} and bind it to the hash exchange",
    "bridge": "unbind partition {queue}, which goes; what the retry ladder brings back to it goes through the hash "
              "exchange",
    "declare-staging": "declare {queue} (takes the waiting events of every partition, in order)",
    "stage": "move the {messages} event(s) of {source} to {queue} (each confirmed, then acked)",
    "route": "send the events of {source} through {queue} (each to its key's new partition)",
    "drain": "send the events of {source} through {queue} until it is empty",
    "hook": "bind the hash exchange {queue} back: new events reach the partitions",
    "unhold": "unbind {queue}",
    "delete": "delete {queue} once empty",
}


@dataclass(frozen=True)
class RepartitionStep:
    """One action on the broker: ``action`` on ``queue`` (the hash exchange for a route), from ``source``."""

    action: str
    queue: str
    source: str = ""
    messages: int = 0

    def describe(self) -> str:
        """One line for the operator."""
        return _SAY[self.action].format(queue=self.queue, source=self.source, messages=self.messages)


@dataclass(frozen=True)
class Observed:
    """What the broker holds of one ordered handler: its partition queues (any count) and its holding queue."""

    partitions: PartitionSet
    existing: dict[str, QueueCounts]
    holding: QueueCounts | None
    staging: QueueCounts | None = None

    @property
    def waiting(self) -> int:
        return sum(count.messages for count in self.existing.values())


def observe(connection: Any, partitions: PartitionSet) -> Observed:
    """Read, with passive declares, what the broker holds of ``partitions``' handler."""
    hold, stage = names.holding_partitions(partitions.queue), names.staging_partitions(partitions.queue)
    counts = peek_queues(connection, [hold, stage])
    return Observed(partitions, existing_partitions(connection, partitions.queue), counts[hold], counts[stage])


def repartition_steps(observed: Observed) -> list[RepartitionStep]:
    """The steps that bring ``observed`` to the app's partitions; none when they are already the broker's.

    MigrationError, before any step, when a partition or the holding queue has a consumer.
    """
    partitions, existing, holding, staging = observed.partitions, observed.existing, observed.holding, observed.staging
    hold, exchange = names.holding_partitions(partitions.queue), partitions.exchange
    stage = names.staging_partitions(partitions.queue)
    attached = {**existing, **{name: count for name, count in ((hold, holding), (stage, staging)) if count}}
    busy = [f"{name} ({count.consumers})" for name, count in attached.items() if count.consumers]
    if busy:
        raise MigrationError(f"consumers are attached to {', '.join(busy)}: stop the service's workers first "
                             "(nothing was changed)")
    targets = [queue.name for queue in partitions.queues]
    if holding is None and staging is None and (not existing or set(existing) == set(targets)):
        return []
    gone = [name for name in existing if name not in targets]
    Step = RepartitionStep
    steps = [] if holding is not None else [Step("declare-holding", hold)]
    steps += [Step("hold", hold), Step("unhook", exchange)]
    steps += [Step("declare", name) for name in targets]
    steps += [Step("bridge", name) for name in gone]
    steps += [] if staging is not None else [Step("declare-staging", stage)]
    steps += [Step("stage", stage, source=name, messages=count.messages) for name, count in existing.items()]
    steps += [Step("route", exchange, source=stage),
              Step("drain", exchange, source=hold, messages=holding.messages if holding else 0),
              Step("hook", exchange), Step("unhold", hold), Step("drain", exchange, source=hold),
              Step("delete", hold), Step("delete", stage)]
    return steps + [Step("delete", name) for name in reversed(gone)]


def execute(connection: Any, topology: Topology, partitions: PartitionSet, steps: Sequence[RepartitionStep],
            report: Callable[[str], Any] = logger.info) -> dict[str, int]:
    """Carry ``steps`` out; the events sent through the hash exchange: ``partitions`` (from the partition
    queues), ``held`` (published during the move) and ``switch`` (published in the instant of the switch)."""
    moved = {"partitions": 0, "held": 0, "switch": 0}
    targets = {queue.name: queue for queue in partitions.queues}
    hooked = False
    for step in steps:
        report(step.describe())
        if step.action == "stage":
            report(f"  moved {_stage(connection, step.source, step.queue)} event(s)")
        elif step.action == "route":
            moved["partitions"] += _through(connection, step.source, partitions.exchange)
            report(f"  sent {moved['partitions']} event(s)")
        elif step.action == "drain":  # before the switch: while events come, for a while at most
            count = _through(connection, step.source, partitions.exchange,
                             until=None if hooked else _after(_DRAIN_S))
            moved["switch" if hooked else "held"] += count
            report(f"  sent {count} event(s)")
        elif step.action == "delete":
            _delete_when_empty(connection, step.queue, partitions.exchange, report)
        else:
            hooked = hooked or step.action == "hook"
            channel = connection.channel()
            try:
                _rebind(channel, topology, partitions, step, targets.get(step.queue))
            finally:
                close_quietly(channel)
    return moved


def _rebind(channel: Any, topology: Topology, partitions: PartitionSet, step: RepartitionStep,
            target: Queue | None) -> None:
    """A declare, bind or unbind step."""
    exchange, action = partitions.exchange, step.action
    if action in ("declare-holding", "declare-staging"):
        kind = (getattr(partitions.queues[0], "queue_arguments", None) or {}).get("x-queue-type", "classic")
        channel.queue_declare(step.queue, durable=True, auto_delete=False, arguments={"x-queue-type": kind})
    elif action in ("hold", "unhold"):
        bind = channel.queue_bind if action == "hold" else channel.queue_unbind
        for source, key in partitions.sources:
            bind(step.queue, exchange=source, routing_key=key)
    elif action in ("hook", "unhook"):
        bind = channel.exchange_bind if action == "hook" else channel.exchange_unbind
        for source, key in partitions.sources:
            bind(destination=exchange, source=source, routing_key=key)
    elif action == "declare":
        assert target is not None
        target.bind(channel).queue_declare()
        for b in target.bindings:
            channel.queue_bind(target.name, exchange=b.exchange.name, routing_key=b.routing_key)
    elif action == "bridge":  # the ladder's way back to the dropped partition now leads through the hash exchange
        delivery, key = names.delivery_exchange(topology.settings.service), topology.delivery_key(step.queue)
        channel.exchange_bind(destination=exchange, source=delivery, routing_key=key)
        channel.queue_unbind(step.queue, exchange=delivery, routing_key=key)
        channel.queue_unbind(step.queue, exchange=exchange, routing_key="1")


def _after(seconds: float) -> Callable[[], bool]:
    """Whether ``seconds`` have passed since this was called."""
    deadline = time.monotonic() + seconds
    return lambda: time.monotonic() > deadline


def _stage(connection: Any, source: str, staging: str) -> int:
    """Move ``source``'s events to ``staging``, in order, each with its routing key in a header."""
    userid = getattr(connection, "userid", None)

    def keyed(message: Any) -> tuple[bytes, dict[str, Any]]:
        properties = copy_properties(message.properties, userid)
        properties["application_headers"][ROUTING_KEY] = _routing_key(message)
        return message.body, properties

    return transfer(connection, source, lambda message: ("", staging), to=staging, copy=keyed)


def _through(connection: Any, source: str, exchange: str, until: Callable[[], bool] | None = None) -> int:
    """Send ``source``'s events through ``exchange`` with their own routing keys, in order."""
    userid = getattr(connection, "userid", None)

    def unkeyed(message: Any) -> tuple[bytes, dict[str, Any]]:
        properties = copy_properties(message.properties, userid)
        properties["application_headers"].pop(ROUTING_KEY, None)
        return message.body, properties

    return transfer(connection, source, lambda message: (exchange, _routing_key(message)), to=exchange,
                    copy=unkeyed, until=until)


def _routing_key(message: Any) -> str:
    """The routing key ``message`` was published with (a staged copy keeps it in a header)."""
    headers = message.properties.get("application_headers") or {}
    key = headers.get(ROUTING_KEY)
    return key.decode() if isinstance(key, bytes) else str(key) if key is not None else \
        message.delivery_info["routing_key"]


def _delete_when_empty(connection: Any, name: str, exchange: str, report: Callable[[str], Any]) -> None:
    """Delete ``name`` once empty; what reached it meanwhile (a publish to it by name) goes through ``exchange``."""
    for _ in range(_DELETE_TRIES):
        counts = peek_queues(connection, [name])[name]
        if counts is None:
            return
        if not counts.messages and not counts.consumers:
            channel = connection.channel()
            try:
                if channel.queue_delete(name):  # came in between: it is unbound, so published to it by name
                    raise MigrationError(f"message(s) were published to {name} by name while it was being "
                                         "deleted, and went with it: stop whatever publishes to it by name")
                return
            finally:
                close_quietly(channel)
        report(f"  {counts.messages} event(s) came to {name} meanwhile: sent through {exchange}")
        _through(connection, name, exchange)
    raise MigrationError(f"queue {name} keeps receiving messages: is something publishing to it by name? "
                         "Run the command again once it stops (nothing was lost)")
