"""A registered handler: the callable, its queue and binding keys, its failure policy."""
from __future__ import annotations

__all__ = ["Handler", "validate_binding_key", "circuit_breaker_of", "check_prefetch"]

from dataclasses import dataclass
from typing import Any, Callable

from .backoff import Backoff
from .circuit import CircuitBreaker
from .errors import ConfigurationError
from .names import MAX_NAME_BYTES


@dataclass(frozen=True)
class Handler:
    """One event handler and the queue it consumes."""

    fn: Callable[..., Any]
    name: str
    queue: str
    binding_keys: tuple[str, ...]
    max_retries: int
    backoff: Backoff
    retry_for: tuple[type[BaseException], ...] = (Exception,)
    dont_retry: tuple[type[BaseException], ...] = ()
    bind: bool = False
    raw: bool = False
    circuit_breaker: CircuitBreaker | None = None
    #: Messages of this queue in flight per worker (None: the service's ``prefetch_count``).
    prefetch: int | None = None
    #: Declare the queue with ``x-single-active-consumer``: one consumer of the fleet receives at a time.
    single_active_consumer: bool = False
    #: Declare the queue with ``x-expires``: deleted once unused (no consumer, no get) this long.
    expires_ms: int | None = None


def validate_binding_key(key: object) -> str:
    """Return ``key`` if it is a valid topic binding key, else raise ConfigurationError."""
    if not isinstance(key, str) or not key:
        raise ConfigurationError(f"binding key must be a non-empty string, got {key!r}")
    if len(key.encode("utf-8")) > MAX_NAME_BYTES:
        raise ConfigurationError(f"binding key {key!r} is longer than {MAX_NAME_BYTES} bytes")
    for word in key.split("."):
        if word not in ("*", "#") and ("*" in word or "#" in word):
            raise ConfigurationError(
                f"binding key {key!r}: a wildcard must be a whole word ('orders.*.created', 'orders.#')"
            )
    return key


def circuit_breaker_of(where: str, value: Any, default: CircuitBreaker | None) -> CircuitBreaker | None:
    """A handler's breaker: ``None`` takes the service's ``default``, ``False`` turns it off."""
    if value is None:
        return default
    if value is False:
        return None
    if isinstance(value, CircuitBreaker):
        return value
    raise ConfigurationError(f"circuit_breaker of {where} must be a CircuitBreaker(...), None (the service's "
                             f"default) or False (none), got {value!r}")


def exception_classes(setting: str, value: Any) -> tuple[type[BaseException], ...]:
    """Normalise ``retry_for``/``dont_retry`` to a tuple of exception classes."""
    items = value if isinstance(value, (tuple, list, set, frozenset)) else (value,)
    for item in items:
        if not (isinstance(item, type) and issubclass(item, BaseException)):
            raise ConfigurationError(f"{setting} must list exception classes, got {item!r}")
    return tuple(items)


def check_prefetch(value: Any) -> int | None:
    """Return a handler's ``prefetch`` (None: the service's), else raise ConfigurationError."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 65_535):
        raise ConfigurationError(f"prefetch must be an integer within 1 .. 65535 or None, got {value!r}")
    return value
