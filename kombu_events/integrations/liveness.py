"""Liveness, ``/healthz``: the worker is alive while its event loop turns (a heartbeat timer on the loop).

Not a health check: those say whether what a handler or the publisher depends on works
(:mod:`kombu_events.core.health` lists the modules about them); liveness says whether the worker itself still runs.
"""
from __future__ import annotations

__all__ = ["Liveness", "liveness_of"]

import logging
import time
from typing import Any, Callable

from ..middleware.base import Middleware

logger = logging.getLogger(__name__)


def liveness_of(last_beat: float | None, now: float, *, max_age_s: float) -> tuple[bool, str]:
    """(alive, why) from when the event loop last beat; pure."""
    if last_beat is None:
        return False, "starting: the event loop has not turned yet"
    age_s = now - last_beat
    if age_s > max_age_s:
        return False, f"stalled: the event loop last turned {age_s:.1f} s ago (more than {max_age_s:g} s)"
    return True, f"ok: the event loop turned {age_s:.1f} s ago"


class Liveness(Middleware):
    """Middleware whose ``started`` beats a heartbeat every ``interval_s`` on the worker's event loop.

    The loop stops beating when it is blocked (a handler running on it under the solo
    pool, a hung hook) or not running (the step is stopped: reconnecting, shutting down).
    """

    def __init__(self, max_age_s: float = 10.0, *, interval_s: float = 1.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.max_age_s = max_age_s
        self.interval_s = interval_s
        self.last_beat: float | None = None
        self._clock = clock

    def started(self, control: Any) -> None:
        """Beat now and every ``interval_s`` until the step stops."""
        self.beat()
        control.call_every(self.interval_s, self.beat)

    def beat(self) -> None:
        """The event loop turned (a float assignment: safe to read from the HTTP thread)."""
        self.last_beat = self._clock()

    def check(self) -> tuple[bool, str]:
        """(alive, why) now."""
        return liveness_of(self.last_beat, self._clock(), max_age_s=self.max_age_s)
