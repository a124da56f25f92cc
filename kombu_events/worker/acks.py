"""Acks sent together: one ``basic.ack`` with ``multiple`` for the deliveries of a channel settled in a row.

Messages are settled out of order (a retry is acked only once its republish is confirmed; a slow handler
holds its message while later ones finish), and ``basic.ack`` with ``multiple`` acks *every* outstanding
delivery up to its tag. So an :class:`AckWindow` keeps the tags delivered and not acked on one channel, in
delivery order, and marks those settled; what it sends covers only a run of consecutive tags, all seen and
all settled, from the oldest one outstanding: one ``multiple`` ack for that run, a plain ack for each settled
tag behind an unsettled one. A tag it never saw (py-amqp rejected a delivery with no consumer) breaks the run.

:class:`Acks` owns the window of the consumers' channel and sends what it says: when the event loop has read
all there is (its tick), when ``limit`` acks wait, after ``MAX_WAIT_S`` at the most, and at stop. Without an
event loop (gevent, eventlet) a flush goes through the :class:`~kombu_events.worker.mailbox.Mailbox` (Celery's
``call_soon``). A new channel (a reconnect) drops the old window: the broker redelivers what it held, at
least once. The consumers are ``no_ack=False`` and nothing reads kombu's ``message.acknowledged``: kombu's
``Message.ack`` is called only for a message of a channel no window tracks.
"""
from __future__ import annotations

__all__ = ["AckWindow", "Acks", "MAX_WAIT_S"]

import logging
import time
from collections import deque
from contextlib import contextmanager
from typing import Any, Callable, Iterator

from .mailbox import Mailbox

logger = logging.getLogger(__name__)

#: The longest a settled message's ack waits to be sent (when the loop keeps reading).
MAX_WAIT_S = 0.05

_NONE_UNSEEN = 1 << 62

#: One ack to send: (delivery tag, multiple, how many deliveries it acks).
AckFrame = tuple[int, bool, int]


class AckWindow:
    """The deliveries of one channel not acked yet, in delivery order, and which of them are settled (pure)."""

    def __init__(self) -> None:
        self._unacked: deque[int] = deque()
        self._outstanding: set[int] = set()
        self._settled: set[int] = set()
        self._last_seen = 0
        #: The lowest tag never seen (tags are 1, 2, 3... on a channel): no ``multiple`` may cover it.
        self._unseen = _NONE_UNSEEN

    def __len__(self) -> int:
        """Settled deliveries whose ack is not sent yet."""
        return len(self._settled)

    def delivered(self, tag: int) -> None:
        """A delivery arrived (tags grow on a channel, one by one)."""
        if tag != self._last_seen + 1 and self._unseen == _NONE_UNSEEN:
            self._unseen = self._last_seen + 1
        self._last_seen = tag
        self._unacked.append(tag)
        self._outstanding.add(tag)

    def settle(self, tag: int) -> bool:
        """Mark ``tag`` settled; False if it is not outstanding here (never seen, or settled already)."""
        if tag not in self._outstanding or tag in self._settled:
            return False
        self._settled.add(tag)
        return True

    def take(self) -> list[AckFrame]:
        """The acks for every settled tag, forgotten here: one ``multiple`` for the run from the oldest
        outstanding tag, a plain one for each of the others."""
        unacked, settled = self._unacked, self._settled
        frames: list[AckFrame] = []
        run: list[int] = []
        while unacked and unacked[0] in settled and unacked[0] < self._unseen:
            run.append(unacked.popleft())
        if run:  # names a tag outstanding: the broker refuses an unknown one, multiple or not
            frames.append((run[-1], len(run) > 1, len(run)))
            settled.difference_update(run)
            self._outstanding.difference_update(run)
        if settled:
            frames.extend((tag, False, 1) for tag in sorted(settled))
            self._unacked = deque(tag for tag in unacked if tag not in settled)
            self._outstanding.difference_update(settled)
            settled.clear()
        return frames


class Acks:
    """The acks of the consumers' channel of one service: settled messages are acked together."""

    def __init__(self, mailbox: Mailbox, *, limit: int = 64) -> None:
        self.mailbox = mailbox
        #: Send once this many acks wait.
        self.limit = limit
        self.channel: Any = None
        self.window = AckWindow()
        #: Whether the connection has more to read now: the acks wait for the end of the read.
        self.more_to_read: Callable[[], bool] = _never
        self._since = 0.0
        self._hub: Any = None
        self._asked = False
        #: Inside :meth:`together`: the limit sends nothing until its end.
        self._together = 0

    def attach(self, channel: Any, hub: Any, *, limit: int, more_to_read: Callable[[], bool]) -> None:
        """A new consumers' channel: what the last one held is dropped (the broker redelivers it)."""
        self.channel, self._hub, self.limit = channel, hub, max(1, limit)
        self.window = AckWindow()
        self.more_to_read = more_to_read if hub is not None else _never
        self._asked = False

    def delivered(self, message: Any) -> None:
        """A message arrived on the consumers' channel (before anything else is done with it)."""
        if getattr(message, "channel", None) is self.channel is not None:
            self.window.delivered(message.delivery_tag)

    def ack(self, message: Any) -> bool:
        """Ack ``message`` (soon, with others); False if its channel failed under us."""
        channel = getattr(message, "channel", None)
        if channel is not self.channel or channel is None:
            message.ack()  # not a delivery of this channel (a channel gone since): on its own, as kombu does
            return True
        if not self.window.settle(message.delivery_tag):  # acked already: a second ack would close the channel
            logger.debug("kombu-events: delivery %r settled twice; acked once", message.delivery_tag)
            return False
        if len(self.window) == 1:
            self._since = time.monotonic()
            if self._hub is None and not self._asked:  # no event loop turning: flush between two reads
                self._asked = True
                self.mailbox.post(self.flush)
        if len(self.window) >= self.limit and not self._together:
            self.flush()
        return True

    @contextmanager
    def together(self) -> Iterator[None]:
        """The acks of what is settled inside go as one frame where they are in a row (a batch's results), not one
        frame per ``limit`` of them; past the limit they are sent at its end."""
        self._together += 1
        try:
            yield
        finally:
            self._together -= 1
            if not self._together and len(self.window) >= self.limit:
                self.flush()

    def tick(self) -> None:
        """Hub tick: send once the loop has read what there was, or the oldest has waited ``MAX_WAIT_S``."""
        try:
            if len(self.window) and (not self.more_to_read() or time.monotonic() - self._since >= MAX_WAIT_S):
                self.flush()
        except Exception:  # never into the hub: its loop would end
            logger.exception("kombu-events: sending acks failed")

    def stop(self) -> None:
        """Send what waits, and from now on each ack at once (the loop no longer ticks for us)."""
        self.limit = 1
        self.flush()

    def flush(self) -> None:
        """Send every ack waiting; a channel that failed drops them (its deliveries come back)."""
        self._asked = False
        channel = self.channel
        for tag, multiple, count in self.window.take():
            try:
                self.send(channel, tag, multiple, count)
            except Exception as exc:
                logger.debug("kombu-events: basic.ack %s (multiple=%s) failed: %s", tag, multiple, exc)
                self.window = AckWindow()
                return

    def send(self, channel: Any, tag: int, multiple: bool, count: int) -> None:
        """One ``basic.ack`` (``count`` deliveries: what the benchmarks' probe counts)."""
        channel.basic_ack(tag, multiple)


def _never() -> bool:
    return False
