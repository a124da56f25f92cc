"""The bytes a service's consumers hold, against ``inflight_max_bytes``: each message counted from its receipt
until it is settled, and the consumers stopped while the :class:`~kombu_events.worker.inflight.InflightBudget`
is spent, started again once it has room.

Stopping and starting happen on the event loop once the callback running now has returned (through the
:class:`~kombu_events.worker.mailbox.Mailbox`), never inside one: cancelling a consumer waits on the
connection that is calling us.
"""
from __future__ import annotations

__all__ = ["Throttle"]

import logging
from typing import Any, Callable

from .inflight import InflightBudget
from .mailbox import Mailbox

logger = logging.getLogger(__name__)


class Throttle:
    """Counts what is held in ``budget``; calls ``stop`` when it is spent and ``start`` when it has room again."""

    def __init__(self, budget: InflightBudget, mailbox: Mailbox, *, service: str, stop: Callable[[], None],
                 start: Callable[[], None], running: Callable[[], bool]) -> None:
        self.budget = budget
        self.mailbox = mailbox
        self.service = service
        self.stop, self.start, self.running = stop, start, running
        #: The messages counted: id(message) -> body bytes.
        self.held: dict[int, int] = {}
        #: Whether the consumers are stopped because the budget is spent; whether a change is posted already.
        self.throttled = self.posted = False

    def reset(self) -> None:
        """Nothing held (a new connection: what the last one delivered is the broker's again)."""
        self.budget.reset()
        self.held = {}
        self.throttled = self.posted = False

    def take(self, message: Any) -> None:
        """Count a message received."""
        size = _body_size(message)
        self.held[id(message)] = size
        self.budget.take(size)
        self._changed()

    def release(self, message: Any) -> None:
        """A message counted is settled, or no longer ours to settle (idempotent)."""
        size = self.held.pop(id(message), None)
        if size is not None:
            self.budget.settle(size)
            self._changed()

    def _changed(self) -> None:
        if self.running() and self.budget.paused != self.throttled and not self.posted:
            self.posted = True
            self.mailbox.post(self._apply)

    def _apply(self) -> None:
        """Mailbox item: stop the consumers while the budget is spent; start them once it is not.

        A message the broker sent before its consumer was cancelled still arrives, and is handled.
        """
        self.posted = False
        if not self.running() or self.budget.paused == self.throttled:
            return
        self.throttled = self.budget.paused
        budget = self.budget
        held = (self.service, budget.in_flight_bytes, budget.in_flight, budget.max_bytes)
        if self.throttled:
            logger.info("kombu-events: service %s holds %d bytes in %d messages, over inflight_max_bytes=%d: "
                        "taking no more until some are settled", *held)
            self.stop()
        else:
            logger.info("kombu-events: service %s holds %d bytes in %d messages, within inflight_max_bytes=%d: "
                        "consuming again", *held)
            self.start()


def _body_size(message: Any) -> int:
    """The size of a message's body as received (0 for one that has none to measure)."""
    try:
        return len(message.body)
    except Exception:
        return 0
