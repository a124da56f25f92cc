"""``Mailbox``: what callbacks and other threads ask of the worker's event loop, run once they have returned.

An effect on the connection asked for from inside a callback that py-amqp is
dispatching (a breaker pausing a queue from a ``settled`` hook, which runs inside a
confirm), or from another thread (a thread pool's result, a health check's result),
must not run there. It is posted here and run on the event loop: with a hub, a byte on
a wake pipe makes the hub drain the mailbox on its next turn; without one (gevent,
eventlet), Celery's ``call_soon`` drains it between two reads of its blocking loop.
"""
from __future__ import annotations

__all__ = ["Mailbox"]

import logging
import os
from collections import deque
from typing import Any, Callable

from ..broker.waits import BrokerSilent

logger = logging.getLogger(__name__)


class Mailbox:
    """The mailbox of one service's consumer on the event loop (``service`` names it in log lines)."""

    def __init__(self, service: str) -> None:
        self.service = service
        self._items: deque[Callable[[], Any]] = deque()
        #: The wake pipe (read end, write end) the hub watches; None without a hub.
        self.pipe: tuple[int, int] | None = None
        #: Without an event loop: Celery's consumer.call_soon, run between two reads of its blocking loop.
        self._call_soon: Callable[[Callable[[], Any]], Any] | None = None
        self._drain_asked = False
        #: Whether the mailbox is being run (an item's wait on the broker may dispatch callbacks that post more).
        self._draining = False

    def watch(self, hub: Any) -> None:
        """Let ``hub`` drain the mailbox whenever something is posted (the pipe is made once, kept across restarts)."""
        if self.pipe is None:
            self.pipe = os.pipe()
            os.set_blocking(self.pipe[0], False)
            os.set_blocking(self.pipe[1], False)
        hub.add_reader(self.pipe[0], self.drain)

    def use_call_soon(self, call_soon: Callable[[Callable[[], Any]], Any] | None) -> None:
        """Without a hub: drain through Celery's ``call_soon`` (None: with a hub, or not at all)."""
        self._call_soon = call_soon

    def post(self, fn: Callable[[], Any]) -> None:
        """Run ``fn`` on the event loop once the callback running now has returned; from any thread.

        Before a hub or ``call_soon`` is set up (nothing is consumed yet) it runs now.
        """
        self._items.append(fn)
        if self.pipe is not None:
            try:
                os.write(self.pipe[1], b"\0")
            except OSError:
                pass  # a wake-up byte is already pending
        elif self._call_soon is not None:
            if not self._drain_asked:
                self._drain_asked = True
                self._call_soon(self.drain)
        else:
            self.drain()  # no loop at all (not started yet, or a test): nothing else would run it

    def drain(self, *_: Any) -> None:
        """Run what was posted, one by one; what they post in turn runs in this same pass.

        An item that raises is logged and skipped, except BrokerSilent: Celery's loop
        takes it as a lost connection and reconnects; the rest waits for then.
        """
        if self._draining:
            return  # an item of this pass is waiting on the broker: the pass runs what was posted meanwhile
        self._drain_asked = False
        self._draining = True
        try:
            try:
                while self.pipe is not None and os.read(self.pipe[0], 4096):
                    pass
            except OSError:
                pass
            while self._items:
                fn = self._items.popleft()
                try:
                    fn()
                except BrokerSilent:
                    raise
                except Exception:
                    logger.exception("kombu-events: %s, queued for the event loop of service %s, failed; skipped",
                                     getattr(fn, "__qualname__", fn), self.service)
        finally:
            self._draining = False

    def close(self, hub: Any) -> None:
        """Stop watching the pipe and close it (shutdown)."""
        if self.pipe is None:
            return
        if hub is not None:
            _quietly(hub.remove, self.pipe[0])
        for fd in self.pipe:
            _quietly(os.close, fd)
        self.pipe = None


def _quietly(fn: Any, *args: Any) -> None:
    try:
        fn(*args)
    except Exception as exc:
        logger.debug("kombu-events: %s failed: %s", getattr(fn, "__name__", fn), exc)
