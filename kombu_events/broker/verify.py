"""Check, without declaring, that a topology is on the broker: what a worker with ``declare=False`` does.

Passive declares need no permission at all, so a runtime user without *configure*
can run them; they say whether an exchange or queue exists, never whether its
arguments match. Those are compared through the management API when it answers
with the same credentials (a user tagged ``monitoring`` or ``management``; never in
plain HTTP for a TLS connection), and trusted otherwise.
"""
from __future__ import annotations

__all__ = ["missing", "differences", "check"]

import base64
import json
import logging
import urllib.parse
import urllib.request
from typing import Any

from ..core.config import management_base_url
from ..core.logs import safe_url
from ..core.topology import Topology
from ..errors import TopologyMissingError
from .declare import absent_exchanges, log_legacy_archive, peek_queues, tolerated

logger = logging.getLogger(__name__)

#: How long the management API may take to answer (the worker is starting, before its event loop).
MANAGEMENT_TIMEOUT_S = 3.0


def missing(topology: Topology, connection: Any) -> list[str]:
    """``exchange 'X'`` / ``queue 'Q'`` for each entity of ``topology`` the broker lacks (passive declares)."""
    found = [f"exchange {name!r}" for name in absent_exchanges(connection, topology.exchanges)]
    counts = peek_queues(connection, [queue.name for queue in topology.queues])
    return found + [f"queue {name!r}" for name, count in counts.items() if count is None]


def differences(topology: Topology, listed: dict[str, dict[str, Any]]) -> list[str]:
    """What differs between ``topology`` and the broker's entities ``listed`` by the management API
    (``{"queue Q": {...}, "exchange X": {...}}``, as :func:`_listing` reads them); pure."""
    found = []
    for exchange in topology.exchanges:
        entity = listed.get(f"exchange {exchange.name}")
        if entity is None:
            continue
        if entity.get("type") != exchange.type:
            found.append(f"exchange {exchange.name!r} is of type {entity.get('type')!r}, not {exchange.type!r}")
        found += _arguments(f"exchange {exchange.name!r}", getattr(exchange, "arguments", None) or {},
                            entity.get("arguments") or {})
    for queue in topology.queues:
        entity = listed.get(f"queue {queue.name}")
        if entity is not None:
            found += _queue_differences(topology, queue, entity)
    return found


def _queue_differences(topology: Topology, queue: Any, entity: dict[str, Any]) -> list[str]:
    """A queue's type is read from the listing's ``type``: RabbitMQ 4 lists ``x-queue-type: classic`` for a
    classic queue declared without it, 3.10 lists nothing. Arguments :func:`tolerated` may differ."""
    expected = dict(getattr(queue, "queue_arguments", None) or {})
    actual = dict(entity.get("arguments") or {})
    if topology.role(queue.name) == "archive" and entity.get("type", "stream") != "stream":
        log_legacy_archive(queue.name, f"type ({entity.get('type')})")  # kept, as declare keeps it
        return []
    allowed = tolerated(topology, queue.name)
    wanted_type = expected.pop("x-queue-type", "classic")
    actual.pop("x-queue-type", None)
    found = []
    if "x-queue-type" not in allowed and entity.get("type", wanted_type) != wanted_type:
        found.append(f"queue {queue.name!r} is a {entity.get('type')} queue, the code declares a {wanted_type} one")
    for key in allowed:
        expected.pop(key, None)
        actual.pop(key, None)
    return found + _arguments(f"queue {queue.name!r}", expected, actual)


def _arguments(what: str, expected: dict[str, Any], actual: dict[str, Any]) -> list[str]:
    return [f"{what} has {key}={actual.get(key)!r}, the code declares {expected.get(key)!r}"
            for key in sorted(set(expected) | set(actual)) if expected.get(key) != actual.get(key)]


def check(topology: Topology, connection: Any, *, command: str, management_url: str | None = None) -> None:
    """Raise TopologyMissingError, naming every missing or different entity and ``command``, unless the
    broker holds ``topology``; the management API's view (at ``management_url``, else at the service's
    ``management_url`` setting) is compared when it answers."""
    problems = missing(topology, connection)
    listed = _listing(connection, management_url or topology.settings.management_url)
    if listed is not None:
        problems += differences(topology, listed)
    if problems:
        raise TopologyMissingError(
            f"service {topology.settings.service} does not declare its topology (declare=False) and the broker "
            f"differs: {'; '.join(problems)}. Create or align it with `{command}` (as a user with configure "
            "permission), then start the worker again")
    logger.info("kombu-events: service %s: topology checked without declaring (%d exchanges, %d queues%s)",
                topology.settings.service, len(topology.exchanges), len(topology.queues),
                "" if listed is not None else "; arguments not compared: management API not usable")


def _listing(connection: Any, management_url: str | None) -> dict[str, dict[str, Any]] | None:
    """Every queue and exchange of the connection's vhost from the management API, None if it does not answer.

    Never over a TLS connection unless ``management_url`` (the setting, or the caller's) names the API: the
    default is plain HTTP on port 15672, and the worker's credentials must not cross the network in the clear
    when its AMQP does not.
    """
    if not management_url and getattr(connection, "ssl", None):
        logger.debug("kombu-events: management API not asked: the broker connection is TLS and no URL was given")
        return None
    base = management_base_url(management_url, connection.hostname)
    vhost = urllib.parse.quote(connection.virtual_host or "/", safe="")
    token = base64.b64encode(f"{connection.userid}:{connection.password}".encode()).decode()
    listed: dict[str, dict[str, Any]] = {}
    try:
        for kind in ("queue", "exchange"):
            url = f"{base}/api/{kind}s/{vhost}?columns=name,type,arguments"
            request = urllib.request.Request(url, headers={"Authorization": f"Basic {token}"})
            with urllib.request.urlopen(request, timeout=MANAGEMENT_TIMEOUT_S) as response:
                listed.update({f"{kind} {entry['name']}": entry for entry in json.load(response)})
    except Exception as exc:  # no plugin, not reachable, or a user without a management tag
        logger.debug("kombu-events: management API %s not usable: %s", safe_url(base), exc)
        return None
    return listed
