"""``Control``: what middleware may do to a running service -- pause and resume its queues, set timers.

The worker hands one ``Control`` per service to :meth:`Middleware.started
<kombu_events.Middleware.started>` each time the events step starts consuming
(Celery restarts the step on every reconnect). Everything runs in the worker's main
process, on its event loop: a circuit breaker pauses a queue, a metrics exporter
refreshes gauges on a timer, without code of theirs in the consumer.
"""
from __future__ import annotations

__all__ = ["Control", "Timer"]

import logging
import threading
from typing import Any, Callable, Protocol

logger = logging.getLogger(__name__)


class Timer(Protocol):
    """A timer set through a :class:`Control`: cancel it, or let it fire."""

    def cancel(self) -> None:
        """Stop it from firing (again)."""


class _Consuming(Protocol):
    """The consumer side of a Control (the worker's ServiceConsumer, or a test double)."""

    def pause_queue(self, queue: str) -> None: ...
    def resume_queue(self, queue: str, prefetch: int | None) -> None: ...
    def call_soon_threadsafe(self, fn: Callable[[], Any]) -> None: ...


class Control:
    """Pause and resume one service's handler queues and set timers, on the worker's event loop.

    A paused queue has no consumer: its messages wait in the broker, no attempt
    spent, and handlers already running finish and settle. It stays paused across
    reconnects until :meth:`resume`. Timers set here are cancelled when the step
    stops; :meth:`Middleware.started` sets them again after a reconnect.
    """

    def __init__(self, service: str, queues: tuple[str, ...], consuming: _Consuming) -> None:
        self.service = service
        #: The service's handler queues, in handler order.
        self.queues = queues
        #: The worker's broker connection while the step runs (for broker queries on the loop), else None.
        self.connection: Any = None
        self._consuming = consuming
        self._paused: dict[str, str] = {}
        self._hub: Any = None
        self._timers: list[Any] = []

    # -- queues ------------------------------------------------------------------------------------

    @property
    def paused(self) -> dict[str, str]:
        """The paused queues and why (a copy)."""
        return dict(self._paused)

    def is_paused(self, queue: str) -> bool:
        """Whether ``queue`` is paused."""
        return queue in self._paused

    def pause(self, queue: str, reason: str = "") -> None:
        """Stop consuming ``queue`` (idempotent); its messages wait in the broker."""
        self._check(queue)
        if queue not in self._paused:
            self._paused[queue] = reason
            self._consuming.pause_queue(queue)
            logger.info("kombu-events: paused %s%s", queue, f": {reason}" if reason else "")

    def resume(self, queue: str, *, prefetch: int | None = None) -> None:
        """Consume ``queue`` again; ``prefetch=1`` takes one message at a time (e.g. a breaker's probe).

        Resuming with another prefetch re-subscribes a queue that is not paused.
        """
        self._check(queue)
        if prefetch is not None and (isinstance(prefetch, bool) or not isinstance(prefetch, int)
                                     or not 1 <= prefetch <= 65535):
            raise ValueError(f"prefetch must be an integer within 1 .. 65535 or None, got {prefetch!r}")
        was_paused = self._paused.pop(queue, None) is not None
        if was_paused or prefetch is not None:
            self._consuming.resume_queue(queue, prefetch)
            logger.info("kombu-events: resumed %s%s", queue, f" (prefetch {prefetch})" if prefetch else "")

    def _check(self, queue: str) -> None:
        if queue not in self.queues:
            raise ValueError(f"{queue!r} is not a handler queue of service {self.service!r} "
                             f"(its queues: {', '.join(self.queues) or 'none'})")

    # -- timers ------------------------------------------------------------------------------------

    def call_after(self, seconds: float, fn: Callable[[], Any]) -> Timer:
        """Call ``fn()`` once, ``seconds`` from now, on the event loop; an exception is logged."""
        return self._add(seconds, fn, repeat=False)

    def call_every(self, seconds: float, fn: Callable[[], Any]) -> Timer:
        """Call ``fn()`` every ``seconds`` on the event loop until cancelled or the step stops."""
        return self._add(seconds, fn, repeat=True)

    def call_soon_threadsafe(self, fn: Callable[[], Any]) -> None:
        """From any thread: call ``fn()`` on the event loop (e.g. with a health check's result)."""
        self._consuming.call_soon_threadsafe(_guarded(fn))

    def _add(self, seconds: float, fn: Callable[[], Any], *, repeat: bool) -> Timer:
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 <= seconds < 86400 * 365:
            raise ValueError(f"seconds must be a number within 0 .. one year, got {seconds!r}")
        guarded = _guarded(fn)
        timer: Timer
        if self._hub is not None:
            timer = self._hub.call_repeatedly(seconds, guarded) if repeat else self._hub.call_later(seconds, guarded)
        else:  # no event loop (gevent/eventlet pools): a thread posts fn to the consumer
            timer = _ThreadTimer(seconds, lambda: self.call_soon_threadsafe(guarded), repeat)
        self._timers.append(timer)
        return timer

    # -- the step's side ---------------------------------------------------------------------------

    def attach(self, connection: Any, hub: Any) -> None:
        """The step started consuming on ``connection`` (called by the consumer)."""
        self.connection, self._hub = connection, hub

    def detach(self) -> None:
        """The step stopped: cancel every timer, forget the connection (called by the consumer)."""
        for timer in self._timers:
            try:
                timer.cancel()
            except Exception as exc:  # a timer of a hub that is already gone
                logger.debug("kombu-events: cancelling a timer failed: %s", exc)
        self._timers = []
        self.connection = None

    def __repr__(self) -> str:
        return f"<Control service={self.service!r} paused={sorted(self._paused)}>"


def _guarded(fn: Callable[[], Any]) -> Callable[[], None]:
    """``fn`` with its exceptions logged: a failing timer must not stop the event loop."""
    def call() -> None:
        try:
            fn()
        except Exception:
            logger.exception("kombu-events: timer %s failed; skipped", getattr(fn, "__qualname__", fn))
    return call


class _ThreadTimer:
    """A (repeating) timer on a daemon thread, for workers without an event loop."""

    def __init__(self, seconds: float, fn: Callable[[], Any], repeat: bool) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(seconds, fn, repeat), daemon=True,
                                        name="kombu-events-timer")
        self._thread.start()

    def _run(self, seconds: float, fn: Callable[[], Any], repeat: bool) -> None:
        while not self._stop.wait(seconds):
            fn()
            if not repeat:
                return

    def cancel(self) -> None:
        self._stop.set()
