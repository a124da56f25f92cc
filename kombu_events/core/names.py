"""Names of the exchanges and queues of a service, and their validation."""
from __future__ import annotations

__all__ = [
    "MAX_NAME_BYTES",
    "validate_name",
    "handler_queue",
    "partition_exchange",
    "partition_queue",
    "partitioned_queue",
    "partition_name",
    "holding_partitions",
    "staging_partitions",
    "delay_name",
    "delay_prefix",
    "delivery_exchange",
    "archive_name",
    "deferred_name",
    "deferred_exchange",
    "unrouted_name",
    "schedule_prefix",
    "schedule_queue",
    "schedule_state",
    "STATE_SUFFIX",
]

import unicodedata

from ..errors import ConfigurationError

#: AMQP short strings (exchange, queue and routing key names) hold at most 255 bytes.
MAX_NAME_BYTES = 255


def validate_name(setting: str, value: object, *, max_bytes: int = MAX_NAME_BYTES) -> str:
    """Return ``value`` if it is a usable exchange/queue name, else raise ConfigurationError."""
    if not isinstance(value, str) or not value.strip():
        raise ConfigurationError(f"{setting} must be a non-empty string, got {value!r}")
    if "*" in value or "#" in value:
        raise ConfigurationError(
            f"{setting}={value!r} contains a topic wildcard ('*' or '#'); "
            "use letters, digits, '.', '-' and '_'"
        )
    if any(ch.isspace() or unicodedata.category(ch).startswith("C") for ch in value):
        raise ConfigurationError(
            f"{setting}={value!r} contains whitespace or control characters; "
            "use letters, digits, '.', '-' and '_'"
        )
    size = len(value.encode("utf-8"))
    if size > max_bytes:
        raise ConfigurationError(
            f"{setting}={value!r} is {size} bytes long; at most {max_bytes} bytes fit"
        )
    return value


def handler_queue(service: str, handler_name: str) -> str:
    """Default queue of a handler: ``<service>.<handler name>``."""
    return f"{service}.{handler_name}"


def partition_exchange(queue: str) -> str:
    """The consistent-hash exchange that spreads an ordered handler's events over its partitions:
    ``<handler queue>.partitions``."""
    return f"{queue}.partitions"


def partitioned_queue(exchange: str) -> str:
    """The ordered handler queue whose consistent-hash exchange is ``exchange``."""
    return exchange[:-len(".partitions")] if exchange.endswith(".partitions") else exchange


def partition_name(queue: str, index: int, width: int) -> str:
    """Partition ``index`` of ``queue`` when the count of partitions has ``width`` digits (zero-padded)."""
    return f"{queue}.p{index:0{width}d}"


def holding_partitions(queue: str) -> str:
    """The queue that holds an ordered handler's new events while its partitions change
    (``kombu-events migrate --partitions``): ``<handler queue>.repartitioning``."""
    return f"{queue}.repartitioning"


def staging_partitions(queue: str) -> str:
    """The queue that takes the events waiting in an ordered handler's partitions, in order, while they change:
    ``<handler queue>.repartitioning.old``."""
    return f"{queue}.repartitioning.old"


def partition_queue(queue: str, index: int, partitions: int) -> str:
    """Partition ``index`` of an ordered handler's ``partitions``: ``<handler queue>.p<index>``, zero-padded so
    that the partitions sort in order (``orders.p00`` .. ``orders.p15``)."""
    return partition_name(queue, index, len(str(partitions - 1)))


def delay_name(service: str, level: int) -> str:
    """Exchange and queue of one level of the delay ladder: ``<service>.delay.<level>``."""
    return f"{delay_prefix(service)}{level}"


def delay_prefix(service: str) -> str:
    """What the names of every level of the delay ladder start with: ``<service>.delay.``."""
    return f"{service}.delay."


def delivery_exchange(service: str) -> str:
    """Exchange that brings a delayed message back to its own queue: ``<service>.delivery``."""
    return f"{service}.delivery"


def archive_name(service: str) -> str:
    """Exchange and queue of the archive: ``<service>.archive``."""
    return f"{service}.archive"


def deferred_name(exchange: str, level: int) -> str:
    """Exchange and queue of one level of an events exchange's own ladder: ``<exchange>.deferred.<level>``.

    Delayed publishing waits here: one ladder per events exchange, shared by every service.
    """
    return f"{deferred_exchange(exchange)}.{level}"


def deferred_exchange(exchange: str) -> str:
    """Exchange where delayed events come due and are routed by their own key: ``<exchange>.deferred``."""
    return f"{exchange}.deferred"


def unrouted_name(exchange: str) -> str:
    """Exchange and queue of delayed events that no queue was bound for when due: ``<exchange>.unrouted``."""
    return f"{exchange}.unrouted"


#: What the state queue of a schedule adds to its token queue's name (a schedule's own name may not end so).
STATE_SUFFIX = ".state"


def schedule_prefix(service: str) -> str:
    """What the names of every schedule queue of a service start with: ``<service>.schedule.``."""
    return f"{service}.schedule."


def schedule_queue(service: str, schedule: str) -> str:
    """Token queue of a periodic schedule: ``<service>.schedule.<schedule>``."""
    return f"{schedule_prefix(service)}{schedule}"


def schedule_state(service: str, schedule: str) -> str:
    """State queue of a periodic schedule (its last run, one message): ``<service>.schedule.<schedule>.state``."""
    return f"{schedule_queue(service, schedule)}{STATE_SUFFIX}"
