"""Names of the exchanges and queues of a service, and their validation."""
from __future__ import annotations

__all__ = [
    "MAX_NAME_BYTES",
    "validate_name",
    "handler_queue",
    "delay_name",
    "delay_prefix",
    "delivery_exchange",
    "archive_name",
]

import unicodedata

from .errors import ConfigurationError

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
