"""``kombu-events health``: is the whole service healthy? One line per problem, from the broker's view."""
from __future__ import annotations

__all__ = ["problems", "missing_exchanges"]

import logging
from typing import Any, Iterable, Sequence

from amqp.exceptions import NotFound

from ..core.topology import Topology
from .status import QueueStatus

logger = logging.getLogger(__name__)

DECLARE_HINT = "run `kombu-events declare` or start a worker"
NO_CONSUMER = "paused: its circuit breaker is open, or no worker runs"


def problems(rows: Sequence[QueueStatus], *, missing: Iterable[str] = (), max_archive: int | None = None) -> list[str]:
    """Every problem of a service, one line each, from its queues' status and its missing exchanges; pure.

    A problem: an exchange or queue that does not exist, a handler queue no worker
    consumes, an archive holding more than ``max_archive`` messages (None: not checked).
    """
    found = [f"exchange {name}: missing ({DECLARE_HINT})" for name in missing]
    for row in rows:
        if not row.exists:
            found.append(f"queue {row.queue}: missing ({DECLARE_HINT})")
        elif row.role == "handler" and not row.consumers:
            found.append(f"queue {row.queue}: no consumer ({NO_CONSUMER})")
        elif row.role == "archive" and max_archive is not None and (row.ready or 0) > max_archive:
            found.append(f"archive {row.queue}: {row.ready} messages, more than --max-archive {max_archive}")
    return found


def missing_exchanges(connection: Any, topology: Topology) -> list[str]:
    """Names of the topology's exchanges the broker does not have (passive declares)."""
    missing = []
    for exchange in topology.exchanges:
        channel = connection.channel()
        try:
            channel.exchange_declare(exchange.name, exchange.type, passive=True)
        except NotFound:
            missing.append(exchange.name)
        finally:
            try:
                channel.close()
            except Exception as exc:  # a failed passive declare already closed the channel
                logger.debug("kombu-events: closing a channel failed: %s", exc)
    return missing
