"""``Batcher``: which received messages go to the pool together, and when a batch is full.

Every job handed to a pool costs the worker's event loop a round trip (pickled through
a pipe to a prefork child and back, or a thread's future and a wake-up), whatever its
handler costs. The consumer therefore collects what arrives while every pool process is
busy, or in one read of the event loop, and hands it to the next free process as one job,
which runs it with :func:`~kombu_events.worker.runner.run_batch` (the consumer decides when:
a process is free and the connection has nothing more to read now, so a lone message waits
for nothing). The batcher says when a batch is full: ``max_messages`` messages, or
about ``budget_ms`` of sync handler time by each queue's recent average (a slow handler's
messages go one by one, to whichever pool process is free, as before). What a message
costs besides its handler (decoding, contracts, middleware contexts, tracing) is learnt
from the batches and counted too. ``async def`` handlers overlap (their batch lasts about
as long as the slowest of them), so their messages count only towards ``max_messages``.
Pure: no I/O.
"""
from __future__ import annotations

__all__ = ["Batcher", "max_messages", "BUDGET_MS", "MAX_MESSAGES"]

from typing import Generic, TypeVar

T = TypeVar("T")

#: Sync handler time a batch may hold (ms), by each queue's recent average: small enough that a batch
#: delays the acks of its messages, and the other pool processes' share of work, by little.
BUDGET_MS = 10.0
#: At most this many messages in a batch, whatever the prefetch.
MAX_MESSAGES = 100
#: Weight of the newest duration in a queue's average handler time.
_WEIGHT = 0.2
#: What a message costs the pool besides its handler, until a batch has shown it (ms): rather too much.
OVERHEAD_MS = 1.0


def max_messages(*, in_flight: int, processes: int) -> int:
    """Largest batch for ``processes`` pool processes (or threads) sharing ``in_flight`` prefetched messages.

    Each process gets its share of what the broker lets the worker hold, so that one
    batch never takes the work the others could do; at most :data:`MAX_MESSAGES`.
    """
    return max(1, min(MAX_MESSAGES, in_flight // max(1, processes)))


class Batcher(Generic[T]):
    """The messages received and not yet handed to the pool, and what their handlers cost so far.

    ``awaited``: the queues whose handlers are ``async def``. A queue whose handler has
    not run yet counts as costing the whole budget, so its first message goes alone.
    ``budget_ms=0``: every sync message goes at once (only ``async def`` ones are batched).
    """

    def __init__(self, *, max_messages: int, awaited: frozenset[str] = frozenset(),
                 budget_ms: float = BUDGET_MS) -> None:
        self.max_messages = max_messages
        self.budget_ms = budget_ms
        self.awaited = awaited
        self._items: list[T] = []
        self._work_ms = 0.0
        self._cost_ms: dict[str, float] = {}
        #: Recent average of what a message costs besides its handler (ms).
        self.overhead_ms = OVERHEAD_MS

    def __len__(self) -> int:
        return len(self._items)

    def add(self, queue: str, item: T) -> bool:
        """Add a message of ``queue``; True when the batch is full and must be handed over now."""
        self._items.append(item)
        if queue not in self.awaited:
            self._work_ms += self._cost_ms.get(queue, self.budget_ms) + self.overhead_ms
        return len(self._items) >= self.max_messages or (self._work_ms > 0 and self._work_ms >= self.budget_ms)

    def take(self) -> list[T]:
        """The batch (possibly empty), in the order received; the batcher starts a new one."""
        items, self._items, self._work_ms = self._items, [], 0.0
        return items

    def observe(self, queue: str, duration_ms: float) -> None:
        """A handler of ``queue`` ran for ``duration_ms``: update the queue's average."""
        if queue in self.awaited or not duration_ms >= 0:
            return
        cost = self._cost_ms.get(queue)
        self._cost_ms[queue] = duration_ms if cost is None else cost + _WEIGHT * (duration_ms - cost)

    def observe_batch(self, durations: list[tuple[str, float]], elapsed_ms: float) -> None:
        """A batch ran: each message's (queue, handler duration), and how long the batch took before any
        ``async def`` handler was awaited (``elapsed_ms``): what is not handler time is overhead."""
        if not durations or not elapsed_ms >= 0:
            return
        handlers_ms, synced = 0.0, 0
        for queue, duration_ms in durations:
            if duration_ms > 0:  # 0: the handler did not run (undecodable, refused by admit)
                self.observe(queue, duration_ms)
            if queue not in self.awaited:
                synced += 1
                handlers_ms += duration_ms if duration_ms > 0 else 0.0
        if not synced:
            return
        overhead = max(0.0, elapsed_ms - handlers_ms) / synced
        self.overhead_ms += _WEIGHT * (overhead - self.overhead_ms)

    def cost_ms(self, queue: str) -> float | None:
        """The recent average handler time of ``queue`` (None: not run yet)."""
        return self._cost_ms.get(queue)
