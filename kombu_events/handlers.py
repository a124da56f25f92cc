"""A registered handler: the callable, its queue and binding keys, its failure policy."""
from __future__ import annotations

__all__ = ["Handler", "validate_binding_key"]

from dataclasses import dataclass
from typing import Any, Callable

from .backoff import Backoff
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


def exception_classes(setting: str, value: Any) -> tuple[type[BaseException], ...]:
    """Normalise ``retry_for``/``dont_retry`` to a tuple of exception classes."""
    items = value if isinstance(value, (tuple, list, set, frozenset)) else (value,)
    for item in items:
        if not (isinstance(item, type) and issubclass(item, BaseException)):
            raise ConfigurationError(f"{setting} must list exception classes, got {item!r}")
    return tuple(items)
