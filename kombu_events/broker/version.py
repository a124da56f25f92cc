"""Which RabbitMQ a connection reached, as the broker told it at connect, and the features that need a newer one.

Pure: everything here reads ``server_properties``, the table the broker sends in
``connection.start`` (py-amqp keeps it on its connection; ``product`` and ``version``
are strings there, bytes in older py-amqp). Nothing opens a socket or a channel.
"""
from __future__ import annotations

__all__ = ["server_properties", "reported_version", "broker_version", "broker_name", "describe", "require",
           "QUORUM_QUEUES"]

import logging
import re
from typing import Any, Mapping

from ..core.logs import safe_url
from ..errors import BrokerTooOldError

logger = logging.getLogger(__name__)

#: Quorum queues (``queue_type="quorum"``) came with RabbitMQ 3.8.
QUORUM_QUEUES = ("quorum queues (queue_type='quorum')", (3, 8))

#: The dotted numbers a version starts with: ``4.0.5`` of ``4.0.5+1.g123`` or ``4.1.0-beta.1``.
_LEADING_NUMBERS = re.compile(r"\s*v?(\d+(?:\.\d+)*)")


def server_properties(connection: Any) -> Mapping[str, Any]:
    """The broker's ``server_properties`` of a py-amqp connection, or of a connected kombu Connection's
    (an unconnected one is not connected here: empty)."""
    found = getattr(connection, "server_properties", None)
    if found is None and getattr(connection, "connected", False):  # kombu: the transport's connection
        found = getattr(getattr(connection, "connection", None), "server_properties", None)
    return found if isinstance(found, Mapping) else {}


def _text(value: Any) -> str | None:
    if isinstance(value, (bytes, bytearray)):
        value = bytes(value).decode("utf-8", "replace")
    if not isinstance(value, str) or not value.strip():
        return None
    return value.strip()


def reported_version(connection: Any) -> str | None:
    """The version as the broker reports it (``"4.0.5"``, ``"3.13.7+1.g123"``), None if it reports none."""
    return _text(server_properties(connection).get("version"))


def broker_version(connection: Any) -> tuple[int, ...] | None:
    """The broker's version as numbers, ``(4, 0, 5)`` (build suffixes dropped); None if unknown or unreadable."""
    text = reported_version(connection)
    found = _LEADING_NUMBERS.match(text or "")
    return tuple(int(part) for part in found.group(1).split(".")) if found else None


def broker_name(connection: Any) -> str:
    """``RabbitMQ 4.0.5``: the product and the version the broker reports (``broker (version unknown)`` when
    it reports neither)."""
    properties = server_properties(connection)
    return f"{_text(properties.get('product')) or 'broker'} {reported_version(connection) or '(version unknown)'}"


def describe(connection: Any) -> str:
    """``RabbitMQ 4.0.5 at amqp://guest:**@127.0.0.1:5680//``: :func:`broker_name` and the URL, password masked."""
    return f"{broker_name(connection)} at {safe_url(_url_of(connection))}"


def require(connection: Any, feature: str, minimum: tuple[int, ...], *, url: str | None = None) -> None:
    """Raise BrokerTooOldError when the RabbitMQ behind ``connection`` is older than ``minimum``.

    A broker that reports no readable version, or is not RabbitMQ, is let through: the
    broker itself refuses what it cannot do. ``url`` (default: the connection's) is shown
    with its password masked.
    """
    running = broker_version(connection)
    product = _text(server_properties(connection).get("product"))
    if running is None or (product is not None and product.lower() != "rabbitmq"):
        logger.debug("kombu-events: %s not checked against the broker's version: %s", feature,
                     broker_name(connection))
        return
    if running >= minimum:
        return
    where = safe_url(url if url is not None else _url_of(connection))
    raise BrokerTooOldError(f"{feature} needs RabbitMQ >= {'.'.join(map(str, minimum))}; the broker at {where} "
                            f"runs {reported_version(connection)}")


def _url_of(connection: Any) -> str:
    """A kombu Connection's URL (password masked by kombu already), else a py-amqp connection's host."""
    as_uri = getattr(connection, "as_uri", None)
    if callable(as_uri):
        return str(as_uri())
    return str(getattr(connection, "host", None) or "an unknown address")
