"""``InflightBudget``: the body bytes a worker holds for one service, and whether it may take more. Pure: no I/O.

RabbitMQ counts a message as delivered once it sends it, and sends as many as a consumer's
prefetch allows whatever their size (it ignores ``prefetch_size`` and a client's ``channel.flow``).
Measured: twelve 15 MiB messages queued for a consumer of prefetch 100 were all unacknowledged
at once, before the client had read a byte. Cancelling a consumer once the bytes are there
comes too late for what the broker already sent, so the budget is kept two ways:

- :meth:`InflightBudget.prefetch` caps the prefetch of a consumer started now so that, if each
  body were as large as ``body_bytes`` (the ``max_body_bytes`` setting), what the broker may send
  fits the room left in the budget (at least one message per consumer);
- :attr:`InflightBudget.paused` says to cancel the service's consumers once the bytes held are over
  the budget (bodies larger than ``body_bytes``, or one each for more queues than the budget holds
  bodies of ``body_bytes``), and to consume again once settling leaves room for one body of
  ``body_bytes`` per consumer, or nothing is held: a restarted consumer is sent its whole prefetch
  again, whatever its cancelled predecessor still holds. Nothing held: never paused, so one body
  larger than the whole budget is still taken, alone.

For bodies up to ``body_bytes``, what is held plus what the broker may still send stays within
``max(max_bytes, consumers * body_bytes)``.
"""
from __future__ import annotations

__all__ = ["InflightBudget"]


class InflightBudget:
    """Bodies received and not yet settled (``in_flight`` messages, ``in_flight_bytes``) against ``max_bytes``.

    ``max_bytes=0``: no budget (never paused; prefetch as asked). ``body_bytes``: the largest
    body expected; ``consumers``: how many consumers share the budget (one per handler queue).
    Counts never go below zero, whatever is settled.
    """

    def __init__(self, *, max_bytes: int, body_bytes: int, consumers: int = 1) -> None:
        self.max_bytes = max(0, max_bytes)
        self.body_bytes = max(1, body_bytes)
        self.consumers = max(1, consumers)
        self.in_flight = 0
        self.in_flight_bytes = 0
        #: Whether to take no more deliveries now.
        self.paused = False

    def take(self, size_bytes: int) -> None:
        """A body of ``size_bytes`` was received."""
        self.in_flight += 1
        self.in_flight_bytes += max(0, size_bytes)
        self._decide()

    def settle(self, size_bytes: int) -> None:
        """A body of ``size_bytes`` taken earlier is settled (acked, or no longer ours to settle)."""
        self.in_flight = max(0, self.in_flight - 1)
        self.in_flight_bytes = max(0, self.in_flight_bytes - max(0, size_bytes)) if self.in_flight else 0
        self._decide()

    def reset(self) -> None:
        """Nothing held (a new connection: what the old one was sent is the broker's again)."""
        self.in_flight = self.in_flight_bytes = 0
        self.paused = False

    @property
    def room_bytes(self) -> int:
        """What the budget has room for now (0 when spent)."""
        return max(0, self.max_bytes - self.in_flight_bytes)

    def prefetch(self, wanted: int, *, floor: int = 1) -> int:
        """The prefetch of a consumer started now that asks for ``wanted``: at most its share of the room
        left, counted in bodies of ``body_bytes``, but never under ``floor`` (the handlers its pool runs at
        once: a smaller prefetch would leave them idle) nor over ``wanted``; at least 1."""
        if not self.max_bytes:
            return max(1, wanted)
        share = self.room_bytes // (self.body_bytes * self.consumers)
        return max(1, min(wanted, max(floor, share)))

    def _decide(self) -> None:
        if not self.max_bytes or not self.in_flight:
            self.paused = False
        elif self.in_flight_bytes > self.max_bytes:
            self.paused = True
        elif self.paused and self.room_bytes >= self.body_bytes * self.consumers:
            self.paused = False
