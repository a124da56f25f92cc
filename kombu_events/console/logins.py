"""Failed logins, counted per client address: after a few, that client waits before it may try again.

A password or a token guessed from one address gets ``free_failures`` tries; then the client is
locked out for ``first_lockout_s``, twice as long after each further failure, at most
``max_lockout_s``. A login that succeeds forgets the client, and so does ``forget_after_s`` without
a failure. The table holds at most ``max_clients`` addresses (the least recently failed go first),
so a flood of addresses costs bounded memory. An IPv6 client counts by its /64 network: one host
usually holds all of it. Pure: the clock is given; :class:`kombu_events.console.app.Guard` answers
a locked-out client 429 with ``Retry-After`` (it never sleeps on the event loop).
"""
from __future__ import annotations

__all__ = ["LoginLimits", "FailedLogins", "client_key", "retry_after"]

import ipaddress
import math
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

from ..errors import ConfigurationError


@dataclass(frozen=True)
class LoginLimits:
    """How failed logins slow a client down (``ConsoleSettings(logins=...)``)."""

    free_failures: int = 5
    first_lockout_s: float = 1.0
    max_lockout_s: float = 60.0
    forget_after_s: float = 900.0
    max_clients: int = 10_000

    def __post_init__(self) -> None:
        if self.free_failures < 1 or self.max_clients < 1:
            raise ConfigurationError(f"LoginLimits: free_failures ({self.free_failures}) and max_clients "
                                     f"({self.max_clients}) must be at least 1")
        if not 0 < self.first_lockout_s <= self.max_lockout_s <= self.forget_after_s:
            raise ConfigurationError(f"LoginLimits: need 0 < first_lockout_s ({self.first_lockout_s}) <= "
                                     f"max_lockout_s ({self.max_lockout_s}) <= forget_after_s ({self.forget_after_s})")

    def lockout_s(self, failures: int) -> float:
        """How long a client with this many failures in a row waits before its next try."""
        if failures < self.free_failures:
            return 0.0
        return min(self.first_lockout_s * 2.0 ** min(failures - self.free_failures, 32), self.max_lockout_s)


def client_key(address: str | None) -> str:
    """The address failures are counted by: an IPv6 address's /64 network, any other address as it is."""
    if not address:
        return "unknown"
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return address
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.ip_network(f"{ip}/64", strict=False))
    return str(ip)


class FailedLogins:
    """Failures in a row per client, and when each failed last; at most ``limits.max_clients`` clients."""

    def __init__(self, limits: LoginLimits | None = None, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.limits = limits or LoginLimits()
        self.clock = clock
        self._table: OrderedDict[str, tuple[int, float]] = OrderedDict()  # key -> (failures, last at)

    def __len__(self) -> int:
        return len(self._table)

    def failures(self, client: str | None) -> int:
        """Failures in a row of this client (0 once forgotten)."""
        return self._entry(client_key(client))[0]

    def wait_s(self, client: str | None) -> float:
        """How long this client must wait before it may try to log in again (0: it may now)."""
        failures, last = self._entry(client_key(client))
        return max(0.0, last + self.limits.lockout_s(failures) - self.clock()) if failures else 0.0

    def failed(self, client: str | None) -> tuple[int, float]:
        """Count a failure of this client: (failures in a row, seconds until it may try again)."""
        key = client_key(client)
        failures = self._entry(key)[0] + 1
        self._table[key] = (failures, self.clock())
        self._table.move_to_end(key)
        while len(self._table) > self.limits.max_clients:
            self._table.popitem(last=False)
        return failures, self.limits.lockout_s(failures)

    def succeeded(self, client: str | None) -> None:
        """A login of this client succeeded: forget its failures."""
        self._table.pop(client_key(client), None)

    def _entry(self, key: str) -> tuple[int, float]:
        failures, last = self._table.get(key, (0, 0.0))
        if failures and self.clock() - last > self.limits.forget_after_s:
            del self._table[key]
            return 0, 0.0
        return failures, last


def retry_after(wait_s: float) -> str:
    """The ``Retry-After`` header for a wait: whole seconds, rounded up, at least 1."""
    return str(max(1, math.ceil(wait_s)))
