"""The publisher's breakers: one per health check, fed by checks and by publishes (pure).

Publishing goes to the broker only while every circuit is closed. A failed publish
counts against the broker's circuit. An open circuit whose reset time has come is
probed by running its check once (half-open): healthy closes it, anything else
trips it again with a longer reset time. A closed circuit whose check has an
``interval_s`` is checked that often. No clock, thread or socket here: the caller
passes ``now``, runs the checks :meth:`PublisherBreakers.due` names, and reports their results.
"""
from __future__ import annotations

__all__ = ["PublisherBreakers", "Change", "PUBLISHER_CIRCUIT", "publisher_policy"]

from dataclasses import dataclass
from typing import Sequence

from ..core.breaker import CLOSED, OPEN, Breaker, CircuitBreaker
from ..core.health import HEALTHY
from ..errors import ConfigurationError
from .health import BROKER, PublisherCheck

#: The publisher's default policy: the publisher already retries its connection, so one
#: failed publish trips the circuit; it is probed after 1 s, then 2, 4 ... up to 30 s.
PUBLISHER_CIRCUIT = CircuitBreaker(max_failures=1, max_unhealthy=1, window_s=10.0, reset_s=1.0, max_reset_s=30.0)


def publisher_policy(policy: CircuitBreaker | None, has_backlog: bool,
                     checks: Sequence[PublisherCheck] = ()) -> CircuitBreaker:
    """``Events(publisher_circuit=...)`` checked: only with a backlog, a CircuitBreaker; the default otherwise."""
    if not has_backlog and (policy is not None or checks):
        raise ConfigurationError("health_checks and publisher_circuit need a backlog: pass backlog=PATH "
                                 "(events wait there while a circuit is open)")
    if policy is not None and not isinstance(policy, CircuitBreaker):
        raise ConfigurationError(f"publisher_circuit must be a CircuitBreaker, got {policy!r}")
    return policy or PUBLISHER_CIRCUIT


@dataclass(frozen=True)
class Change:
    """A circuit changed state (to log, or to signal)."""

    check: str
    state: str
    previous: str
    reason: str
    level: str


class PublisherBreakers:
    """The breakers of one publisher, one per health check (the first one is the broker's)."""

    def __init__(self, checks: Sequence[PublisherCheck], policy: CircuitBreaker = PUBLISHER_CIRCUIT) -> None:
        names = [c.name for c in checks]
        if BROKER not in names:
            raise ConfigurationError(f"the publisher's health checks must include the broker's ({BROKER!r})")
        if len(set(names)) != len(names):
            raise ConfigurationError(f"health check names must be unique, got {names!r}")
        self.checks = {c.name: c for c in checks}
        self.breakers = {c.name: Breaker(c.circuit or policy, name=c.name) for c in checks}
        self._next_run: dict[str, float] = {c.name: 0.0 for c in checks if c.interval_s is not None}

    def closed(self) -> bool:
        """Whether every circuit is closed (publishing may go to the broker)."""
        return all(b.state == CLOSED for b in self.breakers.values())

    def open_reasons(self) -> list[str]:
        """Why publishing goes to the backlog: one line per circuit that is not closed."""
        return [f"circuit {name!r} {b.state}: {b.reason}" for name, b in self.breakers.items() if b.state != CLOSED]

    def periodic(self) -> bool:
        """Whether some check runs on an interval (someone must keep running checks)."""
        return bool(self._next_run)

    def publish_failed(self, now: float, reason: str) -> Change | None:
        """A publish failed because the broker did not answer or confirm."""
        breaker = self.breakers[BROKER]
        previous = breaker.state
        return self._change(breaker, previous, breaker.failure(now, reason), now)

    def due(self, now: float) -> list[PublisherCheck]:
        """The checks to run now: probes of open circuits past their reset time, and periodic ones.

        A probed circuit is half-open from here until its result is reported.
        """
        found = []
        for name, breaker in self.breakers.items():
            probe = breaker.due(now) and breaker.allow(now)
            periodic = breaker.state == CLOSED and now >= self._next_run.get(name, float("inf"))
            if probe or periodic:
                found.append(self.checks[name])
        return found

    def report(self, name: str, status: str, now: float, reason: str = "") -> Change | None:
        """The result of a check that :meth:`due` named."""
        breaker, check = self.breakers[name], self.checks[name]
        previous = breaker.state
        if check.interval_s is not None:
            self._next_run[name] = now + check.interval_s
        if previous == CLOSED:
            return self._change(breaker, previous, breaker.health(status, now, reason), now)
        if status == HEALTHY:
            return self._change(breaker, previous, breaker.success(now), now)
        return self._change(breaker, previous, breaker.failure(now, reason or f"health check {name!r}: {status}"),
                            now)

    def next_due(self, now: float) -> float | None:
        """When :meth:`due` next has something (None: nothing is scheduled)."""
        times = [b.reopens_at for b in self.breakers.values() if b.state == OPEN and b.reopens_at is not None]
        times += [t for name, t in self._next_run.items() if self.breakers[name].state == CLOSED]
        return max(now, min(times)) if times else None

    @staticmethod
    def _change(breaker: Breaker, previous: str, state: str | None, now: float) -> Change | None:
        if state is None or state == previous:
            return None
        return Change(breaker.name, state, previous, breaker.reason, breaker.log_level(now))
