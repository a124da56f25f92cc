"""``kombu-events migrate --partitions``: an ordered handler's waiting events moved to a new count of partitions.

A key's partition is its hash among the partitions bound to the handler's consistent-hash exchange ``X``,
so a new count sends many keys to another partition. With the service's workers stopped (a partition,
holding or staging queue with a consumer is refused, as ``migrate --to`` refuses), for each ordered
handler ``Q`` whose partition queues on the broker are not the app's:

1. declare ``Q.repartitioning`` and bind it as ``X`` is bound (events exchange, due exchange); unbind ``X``:
   from now on new events wait there, in the order the broker received them, and the partitions get none;
2. declare the new partitions and bind them to ``X``; unbind the partitions the new count drops, and bind
   ``Q.repartitioning.returns`` (the *bridge*) where they were bound to the delivery exchange: what the retry
   ladder brings back to them (``hold_failures=False``) goes on through ``X`` (at once; for
   ``ordered_by="routing_key"`` it waits there, and the command sends it with the event's own routing key);
3. move every event waiting in a partition to ``Q.repartitioning.old``, partition after partition, each
   partition's in the order they wait (its own routing key kept in a header): the events of one key all wait
   in one partition, so they stay in order there;
4. declare ``Q.repartitioning.routing`` (a run that stops from here on routes what is left staged before it
   stages anything again), send the staged events through ``X``, each to its key's new partition, in order;
   then the holding queue's, until it is empty (or for a minute at most, if events come faster than they go);
   bind ``X`` back and unbind the holding queue, send what came in that instant (counted); delete the queues
   of the move and the dropped partitions (highest first), each only once empty (what reached it meanwhile
   goes through ``X``, counted); delete the bridge once the service's retry ladder is empty, else leave it to
   a later run (which also unbinds it for a partition it declares again).

Every move is a copy confirmed before its original is acked: nothing is lost, and an event published while
a binding changes goes to both places (a duplicate, at least once). Each key's order is kept, except for an
event that reached the holding queue in the instant of the switch, after its last emptying: it may run after
a later event of its key; the command reports how many came then. A run that stopped anywhere is finished by
running the command again (each step is decided from what the broker holds): nothing is lost, and a key's
events stay in order (a run killed between a copy's confirm and its original's ack leaves a duplicate).

Pure: :func:`repartition_steps`, :func:`reconcile`; :func:`observe` reads the broker, :func:`execute` acts.
"""
from __future__ import annotations

__all__ = ["RepartitionStep", "Observed", "observe", "repartition_steps", "execute", "reconcile", "returns_queue",
           "routing_marker"]

import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from amqp.exceptions import PreconditionFailed
from kombu import Queue

from ..broker.declare import QueueCounts, close_quietly, peek_queues
from ..broker.partitions import consume_partition, existing_partitions
from ..core import names, wire
from ..core.topology import PartitionSet, Topology
from ..errors import HeaderError
from .migrate import MigrationError, copy_properties, transfer

logger = logging.getLogger(__name__)

_DELETE_TRIES = 5
ROUTING_KEY = "x-kombu-events-routing-key"  # a staged event's own routing key (staged copies go to it by name)
_DRAIN_S = 60.0  # emptying the holding queue before the switch, however fast events come: at most this long
_SAY = {
    "declare-holding": "declare {queue} (holds the new events meanwhile)",
    "hold": "bind {queue} as the hash exchange is bound: new events wait there",
    "unhook": "unbind the hash exchange {queue}: the partitions get no new event",
    "reclaim": "unbind {source} for partition {queue} (an earlier run's way back for it)",
    "declare": "declare partition {queue} and bind it to the hash exchange",
    "bridge": "unbind partition {queue}, which goes; what the retry ladder brings back to it goes to {source}, "
              "then through the hash exchange",
    "declare-staging": "declare {queue} (takes the waiting events of every partition, in order)",
    "stage": "move the {messages} event(s) of {source} to {queue} (each confirmed, then acked)",
    "mark": "declare {queue} (a run that stops from here on routes what is staged first)",
    "route": "send the events of {source} through {queue} (each to its key's new partition)",
    "unmark": "delete {queue}",
    "drain": "send the events of {source} through {queue} until it is empty",
    "hook": "bind the hash exchange {queue} back: new events reach the partitions",
    "unhold": "unbind {queue}",
    "delete": "delete {queue} once empty",
    "return": "send the retries waiting in {source} through {queue}, each with its own routing key",
    "unbridge": "delete {queue} (the way back for dropped partitions) if the retry ladder is empty",
}


def returns_queue(queue: str) -> str:
    """The bridge: where the retry ladder's way back to the dropped partitions of ``queue`` leads."""
    return f"{names.holding_partitions(queue)}.returns"


def routing_marker(queue: str) -> str:
    """Exists while the staged events of ``queue`` are being routed: a rerun routes them before staging."""
    return f"{names.holding_partitions(queue)}.routing"


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
    """What the broker holds of one ordered handler: its partition queues (any count), the holding and staging
    queues, the bridge of an earlier run and whether the staged events were being routed."""

    partitions: PartitionSet
    existing: dict[str, QueueCounts]
    holding: QueueCounts | None
    staging: QueueCounts | None = None
    returns: QueueCounts | None = None
    routing: bool = False

    @property
    def waiting(self) -> int:
        return sum(count.messages for count in self.existing.values())


def observe(connection: Any, partitions: PartitionSet) -> Observed:
    """Read, with passive declares, what the broker holds of ``partitions``' handler."""
    queue = partitions.queue
    hold, stage, back, mark = (names.holding_partitions(queue), names.staging_partitions(queue),
                               returns_queue(queue), routing_marker(queue))
    counts = peek_queues(connection, [hold, stage, back, mark])
    return Observed(partitions, existing_partitions(connection, queue), counts[hold], counts[stage], counts[back],
                    counts[mark] is not None)


def repartition_steps(observed: Observed) -> list[RepartitionStep]:
    """The steps that bring ``observed`` to the app's partitions; none when they are already the broker's.

    MigrationError, before any step, when a partition or the holding queue has a consumer and there are
    events to move (the bridge of an earlier run alone is dealt with while workers run).
    """
    partitions, existing, holding, staging = observed.partitions, observed.existing, observed.holding, observed.staging
    hold, exchange = names.holding_partitions(partitions.queue), partitions.exchange
    back = returns_queue(partitions.queue)
    targets = [queue.name for queue in partitions.queues]
    gone = [name for name in existing if name not in targets]
    Step = RepartitionStep
    steps: list[RepartitionStep] = []
    if holding is not None or staging is not None or (existing and set(existing) != set(targets)):
        attached = {**existing, **({hold: holding} if holding else {})}
        busy = [f"{name} ({count.consumers})" for name, count in attached.items() if count.consumers]
        if busy:
            raise MigrationError(f"consumers are attached to {', '.join(busy)}: stop the service's workers first "
                                 "(nothing was changed)")
        steps = [] if holding is not None else [Step("declare-holding", hold)]
        steps += [Step("hold", hold), Step("unhook", exchange)]
        steps += [Step("reclaim", name, source=back) for name in targets if observed.returns is not None]
        steps += [Step("declare", name) for name in targets]
        steps += [Step("bridge", name, source=back) for name in gone]
        steps += _staging_steps(observed)
        steps += [Step("drain", exchange, source=hold, messages=holding.messages if holding else 0),
                  Step("hook", exchange), Step("unhold", hold), Step("drain", exchange, source=hold),
                  Step("delete", hold)]
        steps += [Step("delete", name) for name in reversed(gone)]
    if gone or observed.returns is not None:
        steps += [Step("return", exchange, source=back), Step("unbridge", back)]
    return steps


def _staging_steps(observed: Observed) -> list[RepartitionStep]:
    """Stage every partition's events, then route them; a run stopped while routing routes what is left first
    (the new partitions hold the first part of the staged events: staged again behind the rest, they would
    come after it)."""
    Step, queue, staging = RepartitionStep, observed.partitions.queue, observed.staging
    stage, mark = names.staging_partitions(queue), routing_marker(queue)
    steps: list[RepartitionStep] = []
    if not observed.routing:
        steps += [] if staging is not None else [Step("declare-staging", stage)]
        steps += [Step("stage", stage, source=name, messages=count.messages)
                  for name, count in observed.existing.items()]
        steps += [Step("mark", mark)]
    if observed.routing and staging is None:  # the marker outlived the staging queue
        return [Step("unmark", mark)]
    return [*steps, Step("route", observed.partitions.exchange, source=stage),
            Step("unmark", mark), Step("delete", stage)]


def execute(connection: Any, topology: Topology, partitions: PartitionSet, steps: Sequence[RepartitionStep],
            report: Callable[[str], Any] = logger.info) -> dict[str, int]:
    """Carry ``steps`` out; the counts: ``counted`` (waiting when the steps were decided), ``staged``, and the
    events sent through the hash exchange: ``partitions`` (the staged ones), ``held`` (published during the
    move), ``switch`` (published in the instant of the switch), ``late`` (reached a queue being deleted),
    ``returns`` (retries that came back to the bridge); ``bridge`` is 1 while the bridge stays."""
    moved = dict.fromkeys(("counted", "staged", "staging", "partitions", "held", "switch", "late", "returns",
                           "bridge"), 0)
    targets = {queue.name: queue for queue in partitions.queues}
    hooked, kind = False, _queue_type(partitions)
    for step in steps:
        report(step.describe())
        if step.action == "stage":  # counted once the partitions get no new event
            moved["counted"] += (depth := _depth(connection, step.source))
            count = _stage(connection, step.source, step.queue, depth if kind == "quorum" else None)
            moved["staged"] += count
            report(f"  moved {count} event(s)")
        elif step.action in ("route", "drain", "return"):
            moved["staging"] += _depth(connection, step.source) if step.action == "route" else 0
            count = _through(connection, step.source, partitions.exchange,
                             until=_after(_DRAIN_S) if step.action == "drain" and not hooked else None)
            moved[{"route": "partitions", "return": "returns"}.get(step.action, "switch" if hooked else "held")] \
                += count
            report(f"  sent {count} event(s)")
        elif step.action in ("delete", "unmark"):
            moved["late"] += _delete_when_empty(connection, step.queue, partitions.exchange, report,
                                                "classic" if step.action == "unmark" else kind,
                                                partition=not step.queue.startswith(f"{partitions.queue}.repart"))
        elif step.action == "unbridge":
            moved["bridge"] = _unbridge(connection, topology, step.queue, partitions.exchange, report)
        else:
            hooked = hooked or step.action == "hook"
            channel = connection.channel()
            try:
                _rebind(channel, topology, partitions, step, targets.get(step.queue))
            finally:
                close_quietly(channel)
    return moved


def reconcile(moved: dict[str, int]) -> list[str]:
    """Each mismatch between what :func:`execute` counted waiting and what it moved (none: they agree)."""
    found = []
    if moved["counted"] != moved["staged"]:
        found.append(f"mismatch: {moved['counted']} event(s) counted in the partitions (once they got no new "
                     f"event), {moved['staged']} staged: a retry back from the ladder to a partition, or a message "
                     "published to it by name, meanwhile")
    if moved["staging"] != moved["partitions"]:
        found.append(f"mismatch: {moved['staging']} event(s) counted staged (with what an earlier run staged), "
                     f"{moved['partitions']} sent to the new partitions: a message published to the staging "
                     "queue by name meanwhile?")
    return found


def _depth(connection: Any, name: str) -> int:
    return getattr(peek_queues(connection, [name])[name], "messages", 0)


def _queue_type(partitions: PartitionSet) -> str:
    return str((getattr(partitions.queues[0], "queue_arguments", None) or {}).get("x-queue-type", "classic"))


def _rebind(channel: Any, topology: Topology, partitions: PartitionSet, step: RepartitionStep,
            target: Queue | None) -> None:
    """A declare, bind or unbind step."""
    exchange, action = partitions.exchange, step.action
    if action in ("declare-holding", "declare-staging", "mark"):
        kind = "classic" if action == "mark" else _queue_type(partitions)
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
    elif action == "reclaim":  # a partition declared again takes its way back from the bridge (no duplicate)
        channel.queue_unbind(step.source, exchange=names.delivery_exchange(topology.settings.service),
                             routing_key=topology.delivery_key(step.queue))
    elif action == "bridge":  # the ladder's way back to the dropped partition now leads to the bridge
        delivery, key = names.delivery_exchange(topology.settings.service), topology.delivery_key(step.queue)
        channel.queue_declare(step.source, durable=True, auto_delete=False, arguments=_bridge_arguments(
            topology, exchange))
        channel.queue_bind(step.source, exchange=delivery, routing_key=key)
        channel.queue_unbind(step.queue, exchange=delivery, routing_key=key)
        channel.queue_unbind(step.queue, exchange=exchange, routing_key="1")


def _bridge_arguments(topology: Topology, exchange: str) -> dict[str, Any]:
    """A classic queue (deleted with ``if-empty``) that passes each retry on to the hash exchange at once; with
    ``ordered_by="routing_key"`` (the exchange hashes the routing key, and a retry carries the ladder's) it
    keeps them for the command, which sends each with the event's own routing key."""
    found = next((e for e in topology.exchanges if e.name == exchange), None)
    if found is not None and not getattr(found, "arguments", None):  # hashes the routing key
        return {"x-queue-type": "classic"}
    return {"x-queue-type": "classic", "x-message-ttl": 0, "x-dead-letter-exchange": exchange}


def _unbridge(connection: Any, topology: Topology, bridge: str, exchange: str, report: Callable[[str], Any]) -> int:
    """Delete ``bridge`` if the service's retry ladder is empty (nothing can come back by it); 1 if it stays."""
    if peek_queues(connection, [bridge])[bridge] is None:
        return 0
    # Highest level first: a retry only moves down, so one that moves while they are counted is counted below.
    ladder = [names.delay_name(topology.settings.service, level) for level in reversed(range(
        topology.settings.delay_levels))]
    for attempt in range(2):  # twice: a retry dead-lettered to the next level is in none for an instant
        waiting = sum(count.messages for count in peek_queues(connection, ladder).values() if count)
        if waiting:
            report(f"  the retry ladder holds {waiting} retry(ies): {bridge} stays; run `kombu-events migrate "
                   "--partitions` again once it is empty, to send on what came back and delete it")
            return 1
        time.sleep(0.5 * (1 - attempt))
    _through(connection, bridge, exchange)
    _delete_when_empty(connection, bridge, exchange, report, "classic")
    return 0


def _after(seconds: float) -> Callable[[], bool]:
    """Whether ``seconds`` have passed since this was called."""
    deadline = time.monotonic() + seconds
    return lambda: time.monotonic() > deadline


def _stage(connection: Any, source: str, staging: str, consume: int | None = None) -> int:
    """Move ``source``'s events to ``staging``, in order, each with its own routing key in a header (``consume``:
    that many, with a consumer: a quorum partition refuses ``basic.get``)."""
    userid = getattr(connection, "userid", None)

    def keyed(message: Any) -> tuple[bytes, dict[str, Any]]:
        properties = copy_properties(message.properties, userid)
        properties["application_headers"][ROUTING_KEY] = _routing_key(message, source)
        return message.body, properties

    return _move(connection, source, lambda message: ("", staging), staging, keyed, consume)


def _through(connection: Any, source: str, exchange: str, until: Callable[[], bool] | None = None,
             consume: int | None = None) -> int:
    """Send ``source``'s events through ``exchange`` with their own routing keys, in order."""
    userid = getattr(connection, "userid", None)

    def unkeyed(message: Any) -> tuple[bytes, dict[str, Any]]:
        properties = copy_properties(message.properties, userid)
        properties["application_headers"].pop(ROUTING_KEY, None)
        return message.body, properties

    return _move(connection, source, lambda message: (exchange, _routing_key(message, source)), exchange, unkeyed,
                 consume, until)


def _move(connection: Any, source: str, address: Callable[[Any], tuple[str, str]], to: str,
          copy: Callable[[Any], tuple[bytes, dict[str, Any]]], consume: int | None,
          until: Callable[[], bool] | None = None) -> int:
    """:func:`~kombu_events.ops.migrate.transfer`, or ``consume`` messages with a consumer."""
    if consume is None:  # basic.get
        return transfer(connection, source, address, to=to, copy=copy, until=until)
    moved, failures = consume_partition(connection, source, address, copy, expected=consume)
    if failures:
        raise MigrationError(f"moving {source} -> {to}: the broker refused a copy ({failures[0]}); its original "
                             "stays in place: run the command again")
    return moved


def _routing_key(message: Any, queue: str) -> str:
    """The routing key the event was published with: a staged copy keeps it in a header; a retry back from the
    ladder (its routing key is the ladder's) in the library's header or the broker's ``x-death``."""
    headers = message.properties.get("application_headers") or {}
    key = headers.get(ROUTING_KEY)
    if key is not None:
        return key.decode() if isinstance(key, bytes) else str(key)
    routing_key = message.delivery_info["routing_key"]
    try:
        return wire.original_routing_key(headers, routing_key, queue)
    except HeaderError:  # a malformed header: the routing key it came with
        return str(routing_key)


def _delete_when_empty(connection: Any, name: str, exchange: str, report: Callable[[str], Any], kind: str,
                       partition: bool = False) -> int:
    """Delete ``name`` once empty; what reached it meanwhile (a publish to it by name) goes through ``exchange``
    first: how many. A classic queue is deleted ``if-empty``; a quorum queue refuses the flag, so it is deleted
    right after it was found empty, and what came in between is reported lost."""
    sent = 0
    for _ in range(_DELETE_TRIES):
        counts = peek_queues(connection, [name])[name]
        if counts is None:
            return sent
        if not counts.messages and not counts.consumers and _deleted(connection, name, kind):
            return sent
        report(f"  {counts.messages} event(s) came to {name} meanwhile: sent through {exchange}")
        consume = counts.messages if partition and kind == "quorum" else None  # quorum partitions refuse basic.get
        sent += _through(connection, name, exchange, consume=consume)
    raise MigrationError(f"queue {name} keeps receiving messages: is something publishing to it by name? "
                         "Run the command again once it stops (nothing was lost)")


def _deleted(connection: Any, name: str, kind: str) -> bool:
    """Delete empty ``name``; False when a message came first (a classic queue then stays)."""
    channel = connection.channel()
    try:
        lost = channel.queue_delete(name, if_empty=kind == "classic")
    except PreconditionFailed:  # not empty: the broker closed the channel
        return False
    finally:
        close_quietly(channel)
    if lost:  # a quorum queue, in the instant between the count and the delete: published to it by name
        raise MigrationError(f"{lost} message(s) were published to {name} by name while it was being deleted, and "
                             "went with it: stop whatever publishes to it by name")
    return True
