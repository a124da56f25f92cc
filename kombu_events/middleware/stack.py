"""``MiddlewareStack``: the middleware of one service, in the order the worker runs it.

The user's middleware comes first, then the library's own: Django's connection
tidying in a Django project, the seeder of periodic schedules, and last the circuit
breakers of the handlers that have one (they must see every other hook's answer).
Publishing runs the user's hooks alone (:attr:`MiddlewareStack.publishing`).
"""
from __future__ import annotations

__all__ = ["MiddlewareStack"]

from typing import Callable, Iterable, Sequence

from ..core.handlers import Handler
from ..core.health import HealthCheck
from . import django_connections
from .base import Hooks, Middleware
from .breakers import Breakers


class MiddlewareStack:
    """``middleware`` (the user's) and what the library adds; ``django_mode`` is read when a handler runs."""

    def __init__(self, middleware: Iterable[Middleware], django_mode: Callable[[], str]) -> None:
        self._middleware = (*middleware, *django_connections.middleware_for(django_mode))
        self.publishing = Hooks(self._middleware)  # validates; publishing needs no more
        self.checks: list[HealthCheck] = []
        self._hooks: Hooks | None = None

    def add(self, middleware: Middleware) -> None:
        """Append ``middleware`` after the user's and Django's, for consuming and publishing alike."""
        self.publishing.add(middleware)  # validates
        self._middleware = (*self._middleware, middleware)
        if self._hooks is not None and self._hooks is not self.publishing:
            self._hooks.add(middleware)

    def add_check(self, check: HealthCheck) -> None:
        """A health check of some handlers, run by their circuit breakers."""
        self.checks.append(check)
        self._hooks = None

    def forget(self) -> None:
        """Build the hooks again on next use (handlers or schedules changed)."""
        self._hooks = None

    def hooks(self, handlers: Sequence[Handler], seeder: Middleware | None, *, prefetch_count: Callable[[], int],
              max_delay_ms: Callable[[], int]) -> Hooks:
        """The hooks a worker runs for ``handlers`` (built once, until :meth:`forget`)."""
        if self._hooks is None:
            guarded = [h for h in handlers if h.circuit_breaker is not None]
            seeders = (seeder,) if seeder is not None else ()
            if not guarded and not self.checks:
                self._hooks = Hooks((*self._middleware, *seeders)) if seeders else self.publishing
            else:
                breakers = Breakers(guarded, self.checks, prefetch_count=prefetch_count(),
                                    max_delay_ms=max_delay_ms())
                self._hooks = Hooks((*self._middleware, *seeders, breakers))
        return self._hooks
