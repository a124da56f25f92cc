"""What the queues of a service hold: the counts of every queue (``kombu-events status`` and
``health``) and the depths the metrics watch (handler queues, delay ladder, archive).

Every count is read with passive declares (:func:`kombu_events.broker.declare.peek_queues`);
``unacked`` comes from the management API when it is reachable (at ``--management-url``, else the
service's ``management_url`` setting, else ``http://<broker host>:15672``).
"""
from __future__ import annotations

__all__ = ["QueueStatus", "gather", "queue_statistics", "queue_state", "holder", "CONSUMING", "PAUSED", "DepthTarget",
           "depth_targets", "read_depths"]

import base64
import json
import logging
import urllib.parse
import urllib.request
from dataclasses import asdict, dataclass
from typing import Any, Iterable, NamedTuple

from ..broker.declare import peek_queues
from ..core import names
from ..core.config import management_base_url
from ..core.logs import safe_url
from ..core.topology import Topology
from .archive import LegacyArchiveError, archived_count

logger = logging.getLogger(__name__)


CONSUMING = "consuming"
#: A handler queue with no consumer: its worker paused it (an open circuit breaker), or no worker runs.
PAUSED = "paused"


@dataclass
class QueueStatus:
    """Counts of one queue; ``unacked`` is None when the management API is not reachable.

    ``state`` (handler queues only, else None): ``consuming``, or ``paused`` when it has no consumer.
    """

    queue: str
    role: str  # handler | delay | archive | deferred | unrouted | schedule | state
    ready: int | None
    unacked: int | None
    consumers: int | None
    exists: bool = True
    state: str | None = None
    #: A single-active-consumer queue's (an ordered handler's partition) active consumer: its connection as the
    #: management API names it ("client address -> broker address"); None without one, or without the API.
    holder: str | None = None

    def as_dict(self) -> dict[str, Any]:
        """JSON-friendly form."""
        return asdict(self)


def queue_state(role: str, consumers: int | None) -> str | None:
    """``paused`` for a handler queue nobody consumes, ``consuming`` for one with a consumer, else None."""
    if role != "handler" or consumers is None:
        return None
    return CONSUMING if consumers else PAUSED


def queue_statistics(connection: Any, queue: str, base_url: str) -> dict[str, Any] | None:
    """The management API's record of ``queue`` (asked with the connection's credentials); None if it cannot be had."""
    vhost = urllib.parse.quote(connection.virtual_host or "/", safe="")
    url = f"{base_url.rstrip('/')}/api/queues/{vhost}/{urllib.parse.quote(queue, safe='')}"
    token = base64.b64encode(f"{connection.userid}:{connection.password}".encode()).decode()
    request = urllib.request.Request(url, headers={"Authorization": f"Basic {token}"})
    try:
        with urllib.request.urlopen(request, timeout=3) as response:
            found: dict[str, Any] = json.load(response)
            return found
    except Exception as exc:  # no management plugin, or not reachable: fall back to AMQP counts
        logger.debug("management API %s not usable: %s", safe_url(base_url), exc)
        return None


def gather(connection: Any, topology: Topology, management_url: str | None = None, *,
           archived: int | None = None) -> list[QueueStatus]:
    """Status of every queue of ``topology`` (AMQP counts; unacked from the management API at
    ``management_url``, else at the service's ``management_url`` setting, else on the broker's host). The
    archive's copies are counted by reading the stream, unless the caller knows them (``archived``: the
    console's index)."""
    management_url = management_base_url(management_url or topology.settings.management_url, connection.hostname)
    counts = peek_queues(connection, [q.name for q in topology.queues])
    found = []
    use_api = True
    for queue in topology.queues:
        name, role = queue.name, topology.role(queue.name)
        read = counts[name]
        if read is None:
            found.append(QueueStatus(name, role, None, None, None, exists=False))
            continue
        if role == "archive":  # a stream: its copies are counted by reading it (a read changes nothing)
            found.append(_archive_status(connection, topology, read) if archived is None
                         else QueueStatus(name, role, archived, 0, read.consumers))
            continue
        api = queue_statistics(connection, name, management_url) if use_api else None
        use_api = api is not None
        unacked = api.get("messages_unacknowledged") if api else None
        found.append(QueueStatus(name, role, read.messages, unacked, read.consumers,
                                 state=queue_state(role, read.consumers), holder=holder(api)))
    return found


def holder(api: dict[str, Any] | None) -> str | None:
    """The connection of the active consumer of a single-active-consumer queue, from its management API entry."""
    if not api or not (api.get("arguments") or {}).get("x-single-active-consumer"):
        return None
    for consumer in api.get("consumer_details") or ():
        if isinstance(consumer, dict) and consumer.get("active") is True:
            channel = consumer.get("channel_details") or {}
            name = channel.get("connection_name") if isinstance(channel, dict) else None
            return str(name) if name else None
    return None


def _archive_status(connection: Any, topology: Topology, read: Any) -> QueueStatus:
    """The archive's copies still archived (neither replayed nor purged); an archive of an earlier version (a
    queue, not a stream) is counted by its passive declare, as before."""
    name = topology.archive_exchange
    try:
        pending = archived_count(connection, topology)
    except LegacyArchiveError:
        return QueueStatus(name, "archive", read.messages, None, read.consumers)
    return QueueStatus(name, "archive", pending, 0, read.consumers)


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
    """Ready messages of each of ``queues`` that exists (a missing one is left out), by passive declares."""
    return {name: read.messages for name, read in peek_queues(connection, queues).items() if read is not None}
