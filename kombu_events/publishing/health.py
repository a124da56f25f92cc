"""The publisher's health checks (as in Celery 5's architecture draft, the CEP): the broker answers, and the user's own.

A publisher check is a function returning :class:`~kombu_events.Healthy`, :class:`~kombu_events.Degraded`
or :class:`~kombu_events.Unhealthy`, as a handler's health check does
(:meth:`Events.health_check <kombu_events.Events.health_check>`); it raises or returns
anything else: Unhealthy (``kombu_events.core.health.run_check`` runs it). Each check has
its own breaker (see :mod:`kombu_events.publishing.breakers`): while any is open, events go to
the local backlog instead of the broker. The checks run in the backlog's flusher thread.
The other modules about health are listed in ``kombu_events.core.health``.
"""
from __future__ import annotations

__all__ = ["PublisherCheck", "BrokerAnswers", "broker_check", "as_check", "BROKER"]

import logging
from dataclasses import dataclass
from typing import Any, Callable

from ..broker.connections import broker_connection, failure_reason
from ..core.breaker import CircuitBreaker
from ..core.health import Health, Healthy, Unhealthy
from ..core.logs import safe_text, safe_url
from ..errors import ConfigurationError

logger = logging.getLogger(__name__)

#: Name of the default check (and of the circuit that failed publishes count against).
BROKER = "broker"


@dataclass(frozen=True)
class PublisherCheck:
    """Something publishing depends on: ``fn`` returns ``Healthy``, ``Degraded`` or ``Unhealthy``.

    ``interval_s``: how often it runs while its circuit is closed (None: only as the
    probe of an open circuit). ``circuit``: its breaker's policy (None: the publisher's,
    ``Events(..., publisher_circuit=...)``). ``name``: for logs (default: the function's).
    It runs in the flusher thread: keep it quick (a connect timeout of a second or two).
    """

    fn: Callable[[], Any]
    interval_s: float | None = 10.0
    circuit: CircuitBreaker | None = None
    name: str = ""

    def __post_init__(self) -> None:
        if not callable(self.fn):
            raise ConfigurationError(f"a publisher health check must be a function, got {self.fn!r}")
        if not self.name:
            object.__setattr__(self, "name", str(getattr(self.fn, "__qualname__", None) or self.fn))
        interval = self.interval_s
        if interval is not None and (isinstance(interval, bool) or not isinstance(interval, (int, float))
                                     or not 0 < interval <= 86400):
            raise ConfigurationError(f"interval_s of publisher health check {self.name!r} must be None or a "
                                     f"number of seconds within 0 .. 86400 (0 excluded), got {interval!r}")
        if self.circuit is not None and not isinstance(self.circuit, CircuitBreaker):
            raise ConfigurationError(f"circuit of publisher health check {self.name!r} must be a CircuitBreaker, "
                                     f"got {self.circuit!r}")


class BrokerAnswers:
    """The default check: an AMQP connection to the broker opens within ``timeout_s`` (then closes).

    ``app``: the Celery app whose broker settings (``broker_use_ssl``, ...) the connection takes.
    """

    def __init__(self, url: str, *, timeout_s: float = 2.0, app: Any = None) -> None:
        self.url = url
        self.timeout_s = timeout_s
        self.app = app

    def __call__(self) -> Health:
        connection = broker_connection(self.url, self.app, connect_timeout=self.timeout_s)
        try:
            connection.connect()
        except Exception as exc:
            reason = failure_reason(exc, self.url)
            return Unhealthy(safe_text(f"the broker at {safe_url(self.url)} does not answer: {reason}"))
        finally:
            connection.release()
        return Healthy()

    def __repr__(self) -> str:
        return f"<BrokerAnswers {safe_url(self.url)}>"


def broker_check(url: str, app: Any = None) -> PublisherCheck:
    """The broker's check: a probe only (while its circuit is closed, publishes tell whether it answers)."""
    return PublisherCheck(BrokerAnswers(url, app=app), interval_s=None, name=BROKER)


def as_check(obj: Any) -> PublisherCheck:
    """A :class:`PublisherCheck` as is; a plain function wrapped in one (every 10 s, the publisher's circuit)."""
    if isinstance(obj, PublisherCheck):
        return obj
    if callable(obj):
        return PublisherCheck(obj)
    raise ConfigurationError(f"publisher health checks must be functions or PublisherCheck(...), got {obj!r}")

