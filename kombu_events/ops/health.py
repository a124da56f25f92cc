"""``kombu-events health``: is the whole service healthy? One line per problem, from the broker's view.

Not a health check (those are a handler's or the publisher's: :mod:`kombu_events.core.health` lists them all):
what the broker shows of the service's exchanges, queues, consumers and archive.
"""
from __future__ import annotations

__all__ = ["problems", "reader_problems", "missing_exchanges"]

from typing import Any, Iterable, Sequence

from ..broker.declare import absent_exchanges
from ..core.topology import Topology
from .log_status import ReaderStatus
from .status import QueueStatus

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


def reader_problems(readers: Iterable[ReaderStatus], *, max_lag: int | None = None) -> list[str]:
    """The problems of a service's readers of logs (their queues' status says when one is missing); pure.

    A problem: a reader no worker reads (nobody holds its lock), a reader more than ``max_lag`` events behind
    its log (None: not checked)."""
    found = []
    for r in readers:
        if r.reading is False:
            found.append(f"reader {r.name}: no worker reads it ({NO_CONSUMER})")
        if max_lag is not None and r.lag is not None and r.lag > max_lag:
            found.append(f"reader {r.name}: {r.lag} events behind its log, more than --max-lag {max_lag}")
    return found


def missing_exchanges(connection: Any, topology: Topology) -> list[str]:
    """Names of the topology's exchanges the broker does not have (passive declares)."""
    return absent_exchanges(connection, topology.exchanges)
