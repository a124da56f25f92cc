"""``Gatherer``: the messages of batch handlers' queues, held on the event loop until a batch is full
(``BatchOf.max``) or its first message has waited ``BatchOf.wait_ms``; then one job of the pool.

Without an event loop (a worker that runs no hub: gevent, eventlet) nothing could wake a
waiting batch, so each message goes at once, a list of one. What is held when the connection
is lost is dropped: the broker delivers it again (it was never acked).
"""
from __future__ import annotations

__all__ = ["Gatherer"]

import logging
import time
from typing import Any, Callable, Generic, Mapping, TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T")


class Gatherer(Generic[T]):
    """Held messages per batch queue; ``send(queue, items)`` hands a batch over (on the event loop)."""

    def __init__(self, sizes: Mapping[str, tuple[int, float]], send: Callable[[list[T]], None],
                 clock: Callable[[], float] = time.monotonic) -> None:
        #: Each batch queue's (``max``, ``wait_ms``).
        self.sizes = dict(sizes)
        self.send = send
        self.clock = clock
        self.hub: Any = None
        self._held: dict[str, list[T]] = {}
        self._since: dict[str, float] = {}

    def __contains__(self, queue: object) -> bool:
        return queue in self.sizes

    def held(self, queue: str) -> int:
        """How many messages of ``queue`` wait now."""
        return len(self._held.get(queue, ()))

    def attach(self, hub: Any) -> None:
        """A new connection: what was held is the broker's again; wait for more only with a ``hub``."""
        self.hub = hub
        self._held, self._since = {}, {}

    def add(self, queue: str, item: T) -> None:
        """A message of batch queue ``queue``: sent with its batch when that is full, else held."""
        size, wait_ms = self.sizes[queue]
        held = self._held.setdefault(queue, [])
        held.append(item)
        if len(held) >= size or self.hub is None:
            self._send(queue)
        elif len(held) == 1:
            self._since[queue] = self.clock()
            self.hub.call_later(wait_ms / 1000, self.due, queue)

    def due(self, queue: str) -> None:
        """Hub timer: send ``queue``'s batch if its first message has waited ``wait_ms`` (never raises)."""
        try:
            since = self._since.get(queue)
            if since is not None and self._held.get(queue):
                waited_ms = (self.clock() - since) * 1000
                if waited_ms >= self.sizes[queue][1] - 1:  # a timer may fire a little early
                    self._send(queue)
                else:
                    self.hub.call_later((self.sizes[queue][1] - waited_ms) / 1000, self.due, queue)
        except Exception:  # never into the hub: its loop would end
            logger.exception("kombu-events: handing a batch of %s to the pool failed", queue)

    def _send(self, queue: str) -> None:
        items = self._held.pop(queue, [])
        self._since.pop(queue, None)
        if items:
            self.send(items)
