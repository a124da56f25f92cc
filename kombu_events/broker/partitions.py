"""What the broker holds of an ordered handler's partitions, and the refusal to declare another count over it.

Changing ``partitions`` changes the partition each key hashes to. A worker that declared the new count
over the old partitions would bind the new queues to the hash exchange at once: the events of a key waiting
in its old partition would then run after, or beside, the key's new ones, and an old partition the new count
drops would keep its events where no worker reads. So a worker and ``kombu-events declare`` call
:func:`check_partitions` before they declare: :class:`~kombu_events.errors.PartitionsChangedError` while
the broker holds other partitions than the app's, or a change left unfinished. ``kombu-events migrate
--partitions`` (:mod:`kombu_events.ops.repartition`) moves the events over.

The partition queues of a count are ``<queue>.p0 ..`` with as many digits as the count needs, made in
order and removed highest first: they are found by passive declares from index 0 up, for each width.
A quorum partition (single active consumer) refuses ``basic.get``: :func:`consume_partition` reads one
with a consumer.
"""
from __future__ import annotations

__all__ = ["existing_partitions", "check_partitions", "consume_partition"]

import socket
from typing import Any, Callable

from amqp import Message

from ..core import names, ordering
from ..core.topology import PartitionSet, Topology
from ..errors import PartitionsChangedError
from . import declare
from .confirms import Confirmer

_WIDTHS = range(1, len(str(ordering.MAX_PARTITIONS - 1)) + 1)
_PROBE = 16  # names asked for at once (one passive declare each, on one channel until a missing one)


def existing_partitions(connection: Any, queue: str) -> dict[str, declare.QueueCounts]:
    """Every partition queue of ordered handler ``queue`` the broker holds, whatever count made it, in order."""
    found: dict[str, declare.QueueCounts] = {}
    for width in _WIDTHS:
        last = min(10 ** width, ordering.MAX_PARTITIONS)
        index = 0
        while index < last:
            batch = [names.partition_name(queue, i, width) for i in range(index, min(index + _PROBE, last))]
            counts = declare.peek_queues(connection, batch[:1] if index == 0 else batch)  # most widths have no p0
            present = [(name, counts[name]) for name in counts]
            for name, count in present:
                if count is None:
                    break
                found[name] = count
            if any(count is None for _, count in present):
                break
            index += len(present)
    return found


def check_partitions(topology: Topology, connection: Any) -> None:
    """PartitionsChangedError if an ordered handler of ``topology`` has other partitions on the broker than the
    app declares, or a change of partitions left unfinished; nothing is changed."""
    for partitions in topology.partition_sets():
        unfinished = [name for name, count in declare.peek_queues(connection, [
            names.holding_partitions(partitions.queue), names.staging_partitions(partitions.queue)]).items()
            if count is not None]
        if unfinished:
            raise PartitionsChangedError(
                f"the partitions of handler queue {partitions.queue!r} are being changed ({unfinished[0]} exists: "
                "`kombu-events migrate --partitions` stopped before the end): run it again, then start the "
                "workers (docs/ordering.md)")
        existing = existing_partitions(connection, partitions.queue)
        if existing and set(existing) != {q.name for q in partitions.queues}:
            raise PartitionsChangedError(_changed(partitions, existing))


def _changed(partitions: PartitionSet, existing: dict[str, declare.QueueCounts]) -> str:
    waiting = sum(count.messages for count in existing.values())
    return (f"handler queue {partitions.queue!r} has {len(existing)} partition queue(s) on the broker "
            f"({_span(list(existing))}; {waiting} event(s) waiting) and the app declares "
            f"{len(partitions.queues)}: a new count sends keys to other partitions. Stop the service's workers, run "
            "`kombu-events migrate --partitions` (it moves the waiting events, each key's in order), then start "
            "them (docs/ordering.md)")


def _span(queues: list[str]) -> str:
    return queues[0] if len(queues) == 1 else f"{queues[0]} .. {queues[-1]}"


def consume_partition(connection: Any, source: str, address: Callable[[Any], tuple[str, str]],
                      copy: Callable[[Any], tuple[bytes, dict[str, Any]]], *, expected: int,
                      idle_s: float = 5.0) -> tuple[int, list[str]]:
    """Move ``expected`` messages of ``source`` (fewer if none comes for ``idle_s``), in order, each copy
    published to ``address(message)``, mandatory and confirmed, its original acked once confirmed; with a
    consumer, as a quorum queue with a single active consumer refuses ``basic.get``. (moved, why the broker
    refused a copy); what was delivered but not moved goes back to ``source`` with the channel."""
    channel = connection.channel()
    channel.auto_decode = False  # bodies as they are
    confirmer, failures, delivered = Confirmer(channel), [], []  # type: ignore[var-annotated]
    moved, confirmed = 0, [0]
    try:
        channel.basic_qos(0, max(1, min(expected, 200)), False)
        tag = channel.basic_consume(source, no_ack=False, callback=delivered.append)
        while moved < expected and not failures:
            if not delivered:
                try:
                    connection.drain_events(timeout=idle_s)
                except socket.timeout:
                    break  # nothing more came: fewer than counted
                continue
            message = delivered.pop(0)
            body, properties = copy(message)
            confirmer.publish(Message(body, **properties), *address(message), on_ok=_acker(channel, message, confirmed),
                              on_fail=failures.append)
            moved += 1
        # Acked before the cancel: a quorum queue returns what a cancelled single active consumer holds, and an
        # ack after that finds nothing (the original would stay beside its copy).
        confirmer.wait(timeout_s=30, reraise=True)
        channel.basic_cancel(tag)
    finally:
        declare.close_quietly(channel)
    return confirmed[0], failures


def _acker(channel: Any, message: Any, confirmed: list[int]) -> Callable[[], None]:
    """Ack ``message`` once its copy is confirmed, and count it."""
    def ack() -> None:
        channel.basic_ack(message.delivery_tag)
        confirmed[0] += 1
    return ack
