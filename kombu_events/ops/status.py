"""Depth and consumers of every queue of a service: handler queues, delay levels, archive."""
from __future__ import annotations

__all__ = ["QueueStatus", "gather", "queue_state", "CONSUMING", "PAUSED"]

import base64
import json
import logging
import urllib.parse
import urllib.request
from dataclasses import asdict, dataclass
from typing import Any

from amqp.exceptions import NotFound

from ..core.topology import Topology

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

    def as_dict(self) -> dict[str, Any]:
        """JSON-friendly form."""
        return asdict(self)


def queue_state(role: str, consumers: int | None) -> str | None:
    """``paused`` for a handler queue nobody consumes, ``consuming`` for one with a consumer, else None."""
    if role != "handler" or consumers is None:
        return None
    return CONSUMING if consumers else PAUSED


def _roles(topology: Topology) -> list[tuple[str, str]]:
    return [(q.name, topology.role(q.name)) for q in topology.queues]


def _management(connection: Any, queue: str, base_url: str) -> dict[str, Any] | None:
    vhost = urllib.parse.quote(connection.virtual_host or "/", safe="")
    url = f"{base_url.rstrip('/')}/api/queues/{vhost}/{urllib.parse.quote(queue, safe='')}"
    token = base64.b64encode(f"{connection.userid}:{connection.password}".encode()).decode()
    request = urllib.request.Request(url, headers={"Authorization": f"Basic {token}"})
    try:
        with urllib.request.urlopen(request, timeout=3) as response:
            return json.load(response)
    except Exception as exc:  # no management plugin, or not reachable: fall back to AMQP counts
        logger.debug("management API %s not usable: %s", base_url, exc)
        return None


def gather(connection: Any, topology: Topology, management_url: str | None = None) -> list[QueueStatus]:
    """Status of every queue of ``topology`` (AMQP counts; unacked from the management API)."""
    if management_url is None:
        management_url = f"http://{connection.hostname}:15672"
    found = []
    use_api = True
    for name, role in _roles(topology):
        channel = connection.channel()
        try:
            _n, ready, consumers = channel.queue_declare(name, passive=True)
        except NotFound:
            found.append(QueueStatus(name, role, None, None, None, exists=False))
            continue
        finally:
            try:
                channel.close()
            except Exception:  # a failed passive declare already closed the channel
                pass
        api = _management(connection, name, management_url) if use_api else None
        use_api = api is not None
        unacked = api.get("messages_unacknowledged") if api else None
        found.append(QueueStatus(name, role, ready, unacked, consumers, state=queue_state(role, consumers)))
    return found
