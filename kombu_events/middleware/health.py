"""A handler's health checks in the worker: ``HealthRun`` runs one in a thread of its own and posts its result
back to the event loop, for the handler's breaker (:mod:`kombu_events.middleware.breakers`).

A check may do I/O (ping a database, call an API), so it never runs on the worker's
event loop. One run at a time: a request while a run is in progress waits for that
run's result. A run still going after the check's ``timeout_s`` is reported as
Unhealthy (its thread is left to finish; the next run starts once it has). The other
modules about health are listed in :mod:`kombu_events.core.health`.
"""
from __future__ import annotations

__all__ = ["HealthRun"]

import logging
import threading
from functools import partial
from typing import TYPE_CHECKING, Callable

from ..core.health import HEALTHY, Health, HealthCheck, Unhealthy, run_check

if TYPE_CHECKING:
    from .control import Control, Timer

logger = logging.getLogger(__name__)

Spawn = Callable[[Callable[[], None], str], None]


def spawn_thread(body: Callable[[], None], name: str) -> None:
    """Run ``body`` on a new daemon thread (a hung check must not keep the worker from exiting)."""
    threading.Thread(target=body, name=name, daemon=True).start()


class HealthRun:
    """The runs of one :class:`~kombu_events.core.health.HealthCheck`; ``report(run, health)`` gets each result."""

    def __init__(self, check: HealthCheck, report: Callable[[HealthRun, Health], None], *,
                 spawn: Spawn | None = None) -> None:
        self.check = check
        self.report = report
        self.running = False
        #: The last result (None before the first).
        self.last: Health | None = None
        self._spawn = spawn or spawn_thread
        self._control: Control | None = None
        self._timer: Timer | None = None

    def attach(self, control: Control) -> None:
        """Post results through ``control`` (the step started)."""
        self._control = control
        self._timer = None  # the step's timers were cancelled when it stopped

    def request(self) -> None:
        """Run the check now, unless a run is in progress (its result will do); on the event loop."""
        control = self._control
        if control is None:
            return
        if self._timer is None:
            self._timer = control.call_after(self.check.timeout_s, self._timed_out)
        if not self.running:
            self.running = True
            try:
                self._spawn(partial(self._body, control), f"kombu-events-health-{self.check.name}")
            except Exception:  # e.g. no thread can be started now: the timeout reports it, the next request retries
                self.running = False
                logger.exception("kombu-events: health check %s could not be started", self.check.name)

    def _body(self, control: Control) -> None:
        """The thread: run the check, post the result to the event loop."""
        result = run_check(self.check.fn)
        try:
            control.call_soon_threadsafe(partial(self._done, result))
        except Exception:  # the event loop is gone (the worker stops): the next run may start
            self.running = False
            logger.exception("kombu-events: health check %s: its result %r could not be posted to the event loop",
                             self.check.name, result)

    def _done(self, result: Health) -> None:
        self.running = False
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._result(result)

    def _timed_out(self) -> None:
        self._timer = None
        self._result(Unhealthy(f"health check {self.check.name} still running after {self.check.timeout_s:g} s"))

    def _result(self, result: Health) -> None:
        if self.last is None or result.status != self.last.status:
            level = logging.INFO if result.status == HEALTHY else logging.WARNING
            logger.log(level, "kombu-events: health check %s: %s%s", self.check.name, result.status,
                       f": {result.reason}" if result.reason else "")
        self.last = result
        try:
            self.report(self, result)
        except Exception:
            logger.exception("kombu-events: health check %s: acting on its result %r failed", self.check.name, result)

    def __repr__(self) -> str:
        return f"<HealthRun {self.check.name}{' running' if self.running else ''}>"
