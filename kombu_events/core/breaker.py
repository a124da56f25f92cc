"""Breakers (circuit breakers): the policy, and the pure state machine of one breaker (the clock is passed in).

A :class:`Breaker` is closed until ``max_failures`` failures, ``max_unhealthy``
Unhealthy or ``max_degraded`` Degraded health checks fall within ``window_s``; then
it trips open. After the reset time (``reset_s``, growing linearly or exponentially
with each trip that follows another without a close in between, capped at
``max_reset_s``) it half-opens and lets exactly one probe through: the probe's
success closes it, its failure trips it again. No sockets, no sleeping, no threads:
whoever owns a breaker (the worker for a handler, the publisher for the broker)
feeds it outcomes with ``now`` and acts on the state changes it returns.

Every module about breakers is named for them: this one (pure), the handlers' middleware
(:mod:`kombu_events.middleware.breakers`: pauses a queue) and the publisher's
(:mod:`kombu_events.publishing.breakers`: diverts publishes to the backlog). A circuit is what
a breaker opens and closes (a handler queue, a publisher's check): its state is closed, open or half-open.
"""
from __future__ import annotations

__all__ = ["CircuitBreaker", "Breaker", "CLOSED", "OPEN", "HALF_OPEN"]

import math
from collections import deque
from dataclasses import dataclass

from ..errors import ConfigurationError
from .health import DEGRADED, HEALTH_STATES, HEALTHY, UNHEALTHY

CLOSED = "closed"
OPEN = "open"
HALF_OPEN = "half_open"

GROWTHS = ("exponential", "linear")


@dataclass(frozen=True)
class CircuitBreaker:
    """When a circuit trips, how long it stays open, and when its trips log at error.

    Defaults follow Celery 5's architecture draft (CEP): 2 Unhealthy or 10 Degraded health checks in 10 s trip it,
    and 3 trips within 5 minutes make trips log at error, back to warning 30 minutes
    after the last such trip.
    """

    max_failures: int = 5
    window_s: float = 10.0
    reset_s: float = 30.0
    reset_growth: str = "exponential"
    max_reset_s: float = 600.0
    max_unhealthy: int = 2
    max_degraded: int = 10
    error_after_trips: int = 3
    error_window_s: float = 300.0
    downgrade_after_s: float = 1800.0

    def __post_init__(self) -> None:
        for name in ("max_failures", "max_unhealthy", "max_degraded", "error_after_trips"):
            _check_count(name, getattr(self, name))
        for name in ("window_s", "reset_s", "max_reset_s", "error_window_s", "downgrade_after_s"):
            _check_seconds(name, getattr(self, name))
        if self.reset_growth not in GROWTHS:
            raise ConfigurationError(
                f"CircuitBreaker reset_growth must be one of {', '.join(GROWTHS)}, got {self.reset_growth!r}")
        if self.max_reset_s < self.reset_s:
            raise ConfigurationError(
                f"CircuitBreaker max_reset_s ({self.max_reset_s}) must be at least reset_s ({self.reset_s})")

    def reset_delay_s(self, trips: int) -> float:
        """How long the circuit stays open after its ``trips``-th trip in a row (1-based), capped."""
        n = max(1, trips)
        delay = self.reset_s * n if self.reset_growth == "linear" else self.reset_s * 2.0 ** min(n - 1, 64)
        return min(delay, self.max_reset_s)


def _check_count(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 1_000_000:
        raise ConfigurationError(f"CircuitBreaker {name} must be an integer within 1 .. 1000000, got {value!r}")


def _check_seconds(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or not 0 < value <= 365 * 86400:
        raise ConfigurationError(f"CircuitBreaker {name} must be a number of seconds > 0 (at most a year), "
                                 f"got {value!r}")


class Breaker:
    """The state of one circuit: ``closed``, ``open`` or ``half_open``.

    Every method that can change the state returns the new state, or None if it did
    not change; :attr:`reason` says why it last tripped.
    """

    def __init__(self, policy: CircuitBreaker, name: str = "") -> None:
        self.policy = policy
        self.name = name
        self.state = CLOSED
        self.reason = ""
        #: Trips since the circuit was last closed by a successful probe (drives the reset growth).
        self.trips_in_a_row = 0
        #: When the open circuit half-opens (None unless open).
        self.reopens_at: float | None = None
        self._probing = False
        self._failures: deque[float] = deque()
        self._degraded: deque[float] = deque()
        self._unhealthy: deque[float] = deque()
        self._trip_times: deque[float] = deque()
        self._error_until = -math.inf

    # -- questions -----------------------------------------------------------------------------

    def allow(self, now: float) -> bool:
        """Whether a call may go through now; an open circuit past its reset time half-opens.

        A half-open circuit allows exactly one call (the probe) until it is settled.
        """
        if self.state == CLOSED:
            return True
        if self.state == OPEN:
            if self.reopens_at is None or now < self.reopens_at:
                return False
            self.state = HALF_OPEN
        if self._probing:
            return False
        self._probing = True
        return True

    def due(self, now: float) -> bool:
        """Whether the circuit is open and its reset time has come (it is ready to half-open)."""
        return self.state == OPEN and self.reopens_at is not None and now >= self.reopens_at

    def half_open(self, now: float) -> str | None:
        """An open circuit past its reset time half-opens (no probe taken yet); returns HALF_OPEN then.

        For an owner that half-opens on a timer (e.g. after health checks) and lets
        :meth:`allow` pick the probe when the next call comes.
        """
        if not self.due(now):
            return None
        self.state = HALF_OPEN
        self._probing = False
        return HALF_OPEN

    def release(self) -> None:
        """The probe ended without a result (not run, or an outcome that is neither success nor
        failure): a half-open circuit lets the next call through as its probe."""
        self._probing = False

    def log_level(self, now: float) -> str:
        """``error`` while trips come too often (``error_after_trips`` in ``error_window_s``), else ``warning``."""
        return "error" if now < self._error_until else "warning"

    # -- inputs ----------------------------------------------------------------------------------

    def success(self, now: float) -> str | None:
        """A call succeeded: a half-open circuit closes."""
        if self.state != HALF_OPEN:
            return None
        self._close()
        return CLOSED

    def failure(self, now: float, reason: str = "") -> str | None:
        """A call failed: a closed circuit trips at the threshold; a half-open one trips again.

        A failure reported while the circuit is open (a call started before it tripped) is ignored.
        """
        if self.state == HALF_OPEN:
            return self.trip(now, reason or "the probe failed")
        if self.state == OPEN:
            return None
        if _count(self._failures, now, self.policy.window_s) >= self.policy.max_failures:
            return self.trip(now, reason or f"{self.policy.max_failures} failures within {self.policy.window_s:g} s")
        return None

    def health(self, status: str, now: float, reason: str = "") -> str | None:
        """A health check's result: Unhealthy keeps an open circuit open and trips a half-open one;
        too many Unhealthy or Degraded within the window trip a closed one."""
        if status not in HEALTH_STATES:
            raise ValueError(f"health status must be one of {', '.join(HEALTH_STATES)}, got {status!r}")
        if status == HEALTHY:
            return None
        if self.state != CLOSED:
            return self.trip(now, reason or "health check: unhealthy") if status == UNHEALTHY else None
        window = self.policy.window_s
        if status == UNHEALTHY and _count(self._unhealthy, now, window) >= self.policy.max_unhealthy:
            return self.trip(now, reason or f"{self.policy.max_unhealthy} unhealthy health checks within {window:g} s")
        if status == DEGRADED and _count(self._degraded, now, window) >= self.policy.max_degraded:
            return self.trip(now, reason or f"{self.policy.max_degraded} degraded health checks within {window:g} s")
        return None

    def trip(self, now: float, reason: str = "tripped") -> str | None:
        """Open the circuit now (from any state); an open one starts its reset time anew."""
        previous = self.state
        self.trips_in_a_row += 1
        self.state = OPEN
        self.reason = reason
        self.reopens_at = now + self.policy.reset_delay_s(self.trips_in_a_row)
        self._probing = False
        self._failures.clear()
        self._degraded.clear()
        self._unhealthy.clear()
        if _count(self._trip_times, now, self.policy.error_window_s) >= self.policy.error_after_trips:
            self._error_until = now + self.policy.downgrade_after_s
        return OPEN if previous != OPEN else None

    def _close(self) -> None:
        self.state = CLOSED
        self.reason = ""
        self.trips_in_a_row = 0
        self.reopens_at = None
        self._probing = False

    def __repr__(self) -> str:
        return f"<Breaker {self.name!r} {self.state}>"


def _count(times: deque[float], now: float, window_s: float) -> int:
    """Record an event at ``now``; return how many fall within the last ``window_s`` seconds."""
    times.append(now)
    while times and times[0] <= now - window_s:
        times.popleft()
    return len(times)
