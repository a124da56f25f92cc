"""Health checks: what one returns (``Healthy``, ``Degraded``, ``Unhealthy``), what one is, and how it is run (pure).

A health check is a plain function, registered with ``@events.health_check(handler,
...)`` (or passed to ``Events(health_checks=...)`` for the publisher), that looks at what
a handler or the publisher depends on (a database, an API) and returns one of the three
statuses, optionally with a reason: ``return Unhealthy("db: connection refused")``. The
breakers take the results as inputs, as in the "Worker Health Checks" of Celery 5's
architecture draft (CEP). :func:`run_check` runs one and never raises.

Every module about health is named ``health``, one per layer: this one (the results, pure);
:mod:`kombu_events.middleware.health` (runs a handler's checks in threads for its breaker);
:mod:`kombu_events.publishing.health` (the publisher's checks, the broker's among them);
:mod:`kombu_events.ops.health` (``kombu-events health``: the whole service, from the broker's view).
Whether the worker itself is alive (``/healthz``) is liveness: :mod:`kombu_events.integrations.liveness`.
"""
from __future__ import annotations

__all__ = ["Health", "Healthy", "Degraded", "Unhealthy", "HealthCheck", "run_check", "HEALTHY", "DEGRADED", "UNHEALTHY",
           "HEALTH_STATES"]

import logging
from dataclasses import dataclass
from typing import Any, Callable, ClassVar

from ..errors import ConfigurationError
from .decision import describe

logger = logging.getLogger(__name__)

HEALTHY = "healthy"
DEGRADED = "degraded"
UNHEALTHY = "unhealthy"
#: The statuses a health check returns: a breaker's input (:meth:`~kombu_events.core.breaker.Breaker.health`).
HEALTH_STATES = (HEALTHY, DEGRADED, UNHEALTHY)


class Health:
    """A health check's result: its :attr:`status` and an optional :attr:`reason`."""

    status: ClassVar[str] = ""

    def __init__(self, reason: str = "") -> None:
        self.reason = reason

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and other.reason == self.reason  # type: ignore[attr-defined]

    def __hash__(self) -> int:
        return hash((self.status, self.reason))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.reason!r})" if self.reason else f"{type(self).__name__}()"


class Healthy(Health):
    """The handler will run without errors."""

    status = HEALTHY


class Degraded(Health):
    """The handler may fail (and be retried later)."""

    status = DEGRADED


class Unhealthy(Health):
    """The handler will surely fail: its circuit opens, or stays open."""

    status = UNHEALTHY


@dataclass(frozen=True)
class HealthCheck:
    """A registered health check: the function, the handler functions it serves, how often it runs.

    ``timeout_s``: a check still running after this long counts as Unhealthy (its
    thread is left to finish; the next run starts only once it has).
    """

    fn: Callable[[], Any]
    handlers: tuple[Callable[..., Any], ...]
    interval_s: float = 10.0
    timeout_s: float = 10.0

    def __post_init__(self) -> None:
        if not callable(self.fn):
            raise ConfigurationError(f"a health check must be a function, got {self.fn!r}")
        if not self.handlers:
            raise ConfigurationError(f"health check {_name(self.fn)!r} names no handler it checks")
        for setting in ("interval_s", "timeout_s"):
            value = getattr(self, setting)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 86400:
                raise ConfigurationError(
                    f"health check {_name(self.fn)!r}: {setting} must be a number of seconds within 0 .. 86400 "
                    f"(0 excluded), got {value!r}")

    @property
    def name(self) -> str:
        """The check function's name, for logs."""
        return _name(self.fn)


def run_check(fn: Callable[[], Any]) -> Health:
    """Run one health check; whatever it does, return a :class:`Health` (never raises ``Exception``).

    It may return an instance or the class itself (``return Healthy``); an exception,
    or anything else, is Unhealthy with the reason saying what happened.
    """
    try:
        result = fn()
    except Exception as exc:
        return Unhealthy(f"health check {_name(fn)} raised {describe(exc)}")
    if isinstance(result, type) and issubclass(result, Health) and result.status in HEALTH_STATES:
        return result()
    if isinstance(result, Health) and result.status in HEALTH_STATES:
        return result
    return Unhealthy(f"health check {_name(fn)} returned {result!r}, not Healthy, Degraded or Unhealthy")


def _name(fn: Any) -> str:
    return str(getattr(fn, "__qualname__", None) or fn)
