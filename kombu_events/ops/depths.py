"""How many messages wait in a service's handler queues, delay ladder and archive (passive declares)."""
from __future__ import annotations

__all__ = ["DepthTarget", "depth_targets", "read_depths"]

import logging
from typing import Any, Iterable, NamedTuple

from amqp.exceptions import NotFound

from ..core import names
from ..core.topology import Topology

logger = logging.getLogger(__name__)


class DepthTarget(NamedTuple):
    """One queue whose depth is watched: ``role`` is handler, delay (with its ``level``) or archive."""

    queue: str
    role: str
    level: int = -1


def depth_targets(topology: Topology) -> list[DepthTarget]:
    """Every queue of ``topology`` in the order the ladder reads: handler queues, levels 0 .. N-1, archive."""
    service = topology.settings.service
    found = [DepthTarget(q.name, "handler") for q in topology.handler_queues]
    found += [DepthTarget(names.delay_name(service, level), "delay", level)
              for level in range(topology.settings.delay_levels)]
    found.append(DepthTarget(names.archive_name(service), "archive"))
    return found


def read_depths(connection: Any, queues: Iterable[str]) -> dict[str, int]:
    """Ready messages of each of ``queues`` that exists, on one channel of ``connection`` (closed after).

    One passive ``queue.declare`` round trip per queue. A missing queue is left out (the
    broker closes the channel on it; the next queue gets a fresh one).
    """
    found: dict[str, int] = {}
    channel = None
    try:
        for queue in queues:
            if channel is None:
                channel = connection.channel()
            try:
                _name, ready, _consumers = channel.queue_declare(queue, passive=True)
            except NotFound:
                logger.debug("kombu-events: queue %s does not exist", queue)
                channel = None
                continue
            found[queue] = ready
    finally:
        if channel is not None:
            try:
                channel.close()
            except Exception as exc:  # the connection went away meanwhile
                logger.debug("kombu-events: closing the depth channel failed: %s", exc)
    return found
