"""Ordered handlers (docs/ordering.md): the events of one key handled in publish order, keys in parallel. Pure.

``@events.handler("orders.#", ordered_by="key", partitions=16)`` spreads the handler's events over 16
partition queues through a consistent-hash exchange (RabbitMQ's ``rabbitmq_consistent_hash_exchange``
plugin) that hashes the event's key: one key always reaches one partition. Each partition queue has a
single active consumer in the fleet and one event in flight, so its events run one at a time, in order.
"""
from __future__ import annotations

__all__ = ["Ordering", "check_ordering", "check_key", "check_hold", "MAX_HOLD_MS", "ORDER_KEY_HEADER", "PROPERTIES",
           "HASH_EXCHANGE_TYPE", "PLUGIN"]

from dataclasses import dataclass
from typing import Any

from ..errors import ConfigurationError
from . import wire

#: The header ``ordered_by="key"`` hashes; ``events.publish(..., key=...)`` sets it, any publisher may.
ORDER_KEY_HEADER = wire.ORDER_KEY
#: Message properties the consistent-hash exchange can hash (its ``hash-property`` argument).
PROPERTIES = ("correlation_id", "message_id")
#: The exchange type, and the plugin that brings it (shipped with RabbitMQ, disabled by default).
HASH_EXCHANGE_TYPE = "x-consistent-hash"
PLUGIN = "rabbitmq_consistent_hash_exchange"
#: Partitions a handler may have.
MAX_PARTITIONS = 1024
#: The longest a failing event may hold its partition, its retries' delays added up: half RabbitMQ's default
#: ``consumer_timeout`` (30 minutes), past which the broker closes the channel of a delivery left unacked.
MAX_HOLD_MS = 15 * 60 * 1000


@dataclass(frozen=True)
class Ordering:
    """What orders a handler's events (``by``) and over how many partition queues they spread.

    ``hold_failures``: a failing event holds its partition, its retries run before any later event of the
    partition (True, the default); False lets it go through the retry ladder while later events pass it.
    """

    by: str
    partitions: int
    hold_failures: bool = True

    def exchange_arguments(self) -> dict[str, Any]:
        """The consistent-hash exchange's arguments: which header or property it hashes (none: the routing key)."""
        if self.by == "routing_key":
            return {}
        if self.by == "key":
            return {"hash-header": ORDER_KEY_HEADER}
        if self.by.startswith("header:"):
            return {"hash-header": self.by[len("header:"):]}
        return {"hash-property": self.by}


def check_hold(handler: str, ordering: Ordering | None, *, max_retries: int, backoff: Any) -> None:
    """ConfigurationError if a failing event of ``handler`` could hold its partition (``hold_failures``) longer
    than :data:`MAX_HOLD_MS`: its backoff's longest delays for ``max_retries`` retries, added up."""
    if ordering is None or not ordering.hold_failures:
        return
    held = sum(backoff.delay_ms(retry=retry, rand=lambda: 0.0) for retry in range(1, max_retries + 1))
    if held > MAX_HOLD_MS:
        raise ConfigurationError(
            f"handler {handler!r} holds a failing event's partition (hold_failures=True) for up to {held / 1000:g} s "
            f"({max_retries} retries with its backoff), more than {MAX_HOLD_MS // 60_000} minutes: RabbitMQ closes "
            "the channel of a delivery unacked for its consumer_timeout (30 minutes by default). Lower max_retries "
            "or the backoff's max_delay_ms, or pass hold_failures=False (docs/ordering.md)")


def check_key(key: Any) -> str:
    """An event's ordering key (``publish(..., key=)``): a non-empty string, else ConfigurationError."""
    if not isinstance(key, str) or not key:
        raise ConfigurationError(f"key must be a non-empty string (what orders the events of a handler ordered by "
                                 f"'key'), got {key!r}")
    return key


def check_ordering(ordered_by: Any, partitions: Any, hold_failures: Any) -> Ordering | None:
    """The handler options ``ordered_by``, ``partitions`` and ``hold_failures`` as an Ordering (None: not
    ordered), else ConfigurationError."""
    if ordered_by is None:
        if partitions is not None:
            raise ConfigurationError("partitions= needs ordered_by= (what orders the events: 'key', 'routing_key', "
                                     "'correlation_id', 'message_id' or 'header:<name>')")
        return None
    valid = ("key", "routing_key", *PROPERTIES)
    if not isinstance(ordered_by, str) or not (
            ordered_by in valid or (ordered_by.startswith("header:") and ordered_by[len("header:"):].strip())):
        raise ConfigurationError(f"ordered_by must be one of {', '.join(map(repr, valid))} or 'header:<name>', "
                                 f"got {ordered_by!r}")
    if isinstance(partitions, bool) or not isinstance(partitions, int) or not 1 <= partitions <= MAX_PARTITIONS:
        raise ConfigurationError(f"partitions must be an integer within 1 .. {MAX_PARTITIONS} (the partition "
                                 f"queues an ordered handler's events spread over), got {partitions!r}")
    if not isinstance(hold_failures, bool):
        raise ConfigurationError(f"hold_failures must be True or False, got {hold_failures!r}")
    return Ordering(ordered_by, partitions, hold_failures)
