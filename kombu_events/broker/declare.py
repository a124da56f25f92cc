"""Declare a topology on the broker, idempotently; conflicts become TopologyConflictError."""
from __future__ import annotations

__all__ = ["declare", "declare_queue", "conflict_error"]

import logging
import re
from typing import Any

from amqp.exceptions import PreconditionFailed

from ..core.topology import Topology
from ..errors import TopologyConflictError

logger = logging.getLogger(__name__)

_INEQUIVALENT = re.compile(r"inequivalent arg '([^']+)' for (queue|exchange) '([^']+)'")
_INVALID = re.compile(r"invalid arg '([^']+)' for (queue|exchange) '([^']+)'")


def conflict_error(exc: PreconditionFailed, kind: str, name: str) -> TopologyConflictError:
    """A clear error for a PRECONDITION_FAILED on declaring ``kind`` ``name``."""
    text = str(getattr(exc, "reply_text", "") or exc)
    invalid = _INVALID.search(text)
    if invalid:  # not a conflict: RabbitMQ refuses the value itself
        return TopologyConflictError(f"RabbitMQ refused argument {invalid.group(1)!r} of {kind} {name!r}: {text}. "
                                     "Change the setting that produces it.", entity=name, argument=invalid.group(1))
    found = _INEQUIVALENT.search(text)
    argument = found.group(1) if found else None
    what = f"argument {argument!r}" if argument else "set of arguments"
    fix = "Delete it (after draining it) or align the settings, then declare again."
    if kind == "queue":  # the queue type, or any argument: migrate recreates it with its messages
        fix += (" To recreate the service's queues with their messages (from classic to quorum, or back), stop its "
                "workers and run `kombu-events migrate --to quorum` (or `--to classic`).")
    return TopologyConflictError(f"{kind} {name!r} already exists on the broker with a different {what}: {text}. {fix}",
                                 entity=name, argument=argument)


def declare(topology: Topology, connection: Any) -> dict[str, int]:
    """Declare every entity of ``topology`` on a fresh channel of ``connection``; return counts."""
    channel = connection.channel()
    try:
        counts = {"exchanges": 0, "queues": 0, "bindings": 0, "exchange_bindings": 0}
        for exchange in topology.exchanges:
            _guard("exchange", exchange.name, exchange.bind(channel).declare)
            counts["exchanges"] += 1
        for queue in topology.queues:
            bound = queue.bind(channel)
            _guard("queue", queue.name, bound.queue_declare)
            for b in queue.bindings:
                bound.bind_to(exchange=b.exchange.name, routing_key=b.routing_key)
                counts["bindings"] += 1
            counts["queues"] += 1
        for link in topology.exchange_bindings:
            link.destination.bind(channel).bind_to(exchange=link.source.name, routing_key=link.routing_key)
            counts["exchange_bindings"] += 1
        logger.info("declared topology of service %s: %s", topology.settings.service, counts)
        return counts
    finally:
        try:
            channel.close()
        except Exception:  # a failed declare already closed the channel
            pass


def _guard(kind: str, name: str, fn: Any) -> None:
    try:
        fn()
    except PreconditionFailed as exc:
        raise conflict_error(exc, kind, name) from exc


def declare_queue(channel: Any, queue: Any) -> None:
    """Declare one unbound kombu ``queue`` of a topology (no bindings) on ``channel``, e.g. one that expired."""
    _guard("queue", queue.name, queue.bind(channel).queue_declare)
