"""``Control``: what middleware may do to a running service -- pause and resume its queues, set timers.

The worker hands one ``Control`` per service to :meth:`Middleware.started
<kombu_events.Middleware.started>` each time the events step starts consuming
(Celery restarts the step on every reconnect). Everything runs in the worker's main
process, on its event loop: a circuit breaker pauses a queue, a metrics exporter
refreshes gauges on a timer, without code of theirs in the consumer.

Every method may be called from any hook, any thread, at any time. ``pause`` and
``resume`` change the wanted state at once and queue its effect on the connection
(cancel, qos, consume) to the event loop, where it runs after the callback that
asked for it has returned: a hook called from inside a broker callback (a confirm,
a delivery) never drains frames of the connection that is calling it.
"""
from __future__ import annotations

__all__ = ["Control", "Timer"]

import logging
import threading
from functools import partial
from typing import Any, Callable, Protocol

from ..broker.waits import BrokerSilent
from ..core.logs import escape_controls

logger = logging.getLogger(__name__)


class Timer(Protocol):
    """A timer set through a :class:`Control`: cancel it, or let it fire."""

    def cancel(self) -> None:
        """Stop it from firing (again)."""


class _Consuming(Protocol):
    """The consumer side of a Control (the worker's ServiceConsumer, or a test double)."""

    def pause_queue(self, queue: str) -> None: ...
    def resume_queue(self, queue: str, prefetch: int | None) -> None: ...
    def call_soon_threadsafe(self, fn: Callable[[], Any]) -> None:
        """Run ``fn`` on the event loop after the callback running now (if any) returns; from any thread."""


class Control:
    """Pause and resume one service's handler queues and set timers, on the worker's event loop.

    A paused queue has no consumer: its messages wait in the broker, no attempt
    spent, and handlers already running finish and settle. It stays paused across
    reconnects until :meth:`resume`. Timers set here are cancelled when the step
    stops; :meth:`Middleware.started <kombu_events.Middleware.started>` sets them again after a reconnect.
    """

    def __init__(self, service: str, queues: tuple[str, ...], consuming: _Consuming) -> None:
        self.service = service
        #: The service's handler queues, in handler order.
        self.queues = queues
        #: The worker's broker connection while the step runs (for broker queries on the loop), else None.
        self.connection: Any = None
        self._consuming = consuming
        self._paused: dict[str, str] = {}
        #: Per queue, a count of pause/resume requests: a queued effect that a later one superseded is skipped.
        self._generation: dict[str, int] = dict.fromkeys(queues, 0)
        self._lock = threading.Lock()
        self._hub: Any = None
        self._loop_ident: int | None = None
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
        """Stop consuming ``queue`` (idempotent); its messages wait in the broker.

        The consumer is cancelled on the event loop once the current callback returns.
        """
        self._check(queue)
        with self._lock:
            if queue in self._paused:
                return
            self._paused[queue] = reason
            generation = self._request(queue)
        logger.info("kombu-events: paused %s%s", queue, f": {escape_controls(reason)}" if reason else "")
        self._consuming.call_soon_threadsafe(partial(self._apply, queue, generation, None))

    def resume(self, queue: str, *, prefetch: int | None = None) -> None:
        """Consume ``queue`` again; ``prefetch=1`` takes one message at a time (e.g. a breaker's probe).

        Resuming with another prefetch re-subscribes a queue that is not paused. The
        consumer starts on the event loop once the current callback returns.
        """
        self._check(queue)
        if prefetch is not None and (isinstance(prefetch, bool) or not isinstance(prefetch, int)
                                     or not 1 <= prefetch <= 65535):
            raise ValueError(f"prefetch must be an integer within 1 .. 65535 or None, got {prefetch!r}")
        with self._lock:
            was_paused = self._paused.pop(queue, None) is not None
            if not (was_paused or prefetch is not None):
                return
            generation = self._request(queue)
        logger.info("kombu-events: resumed %s%s", queue, f" (prefetch {prefetch})" if prefetch else "")
        self._consuming.call_soon_threadsafe(partial(self._apply, queue, generation, prefetch))

    def _request(self, queue: str) -> int:
        """Count a pause/resume of ``queue`` (under the lock); the number its queued effect carries."""
        self._generation[queue] += 1
        return self._generation[queue]

    def _apply(self, queue: str, generation: int, prefetch: int | None) -> None:
        """On the event loop: make the consumer of ``queue`` what the latest request asked for."""
        with self._lock:
            if self._generation[queue] != generation:
                return  # a later pause/resume was queued after this one: it decides
            paused = queue in self._paused
        if paused:
            self._consuming.pause_queue(queue)
        else:
            self._consuming.resume_queue(queue, prefetch)

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
        hub = self._hub
        if hub is not None and threading.get_ident() == self._loop_ident:
            timer = hub.call_repeatedly(seconds, guarded) if repeat else hub.call_later(seconds, guarded)
        elif hub is not None:  # another thread: the hub's timers are the loop's own; set it there
            timer = _LoopTimer(hub, seconds, guarded, repeat)
            self.call_soon_threadsafe(timer.arm)
        else:  # no event loop (gevent/eventlet pools): a thread posts fn to the consumer
            timer = _ThreadTimer(seconds, lambda: self.call_soon_threadsafe(guarded), repeat)
        self._timers.append(timer)
        return timer

    # -- the step's side ---------------------------------------------------------------------------

    def attach(self, connection: Any, hub: Any) -> None:
        """The step started consuming on ``connection`` (called by the consumer, on the event loop)."""
        self.connection, self._hub = connection, hub
        self._loop_ident = threading.get_ident()

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
    """``fn`` with its exceptions logged: a failing timer or queued callable must not stop the event loop."""
    def call() -> None:
        try:
            fn()
        except BrokerSilent:
            raise  # the connection is lost: Celery's loop reconnects (see kombu_events.broker.waits)
        except Exception:
            logger.exception("kombu-events: %s, run on the event loop, failed; skipped",
                             getattr(fn, "__qualname__", fn))
    return call


class _LoopTimer:
    """A hub timer asked for from another thread: set on the event loop, unless cancelled first."""

    def __init__(self, hub: Any, seconds: float, fn: Callable[[], Any], repeat: bool) -> None:
        self._hub, self._seconds, self._fn, self._repeat = hub, seconds, fn, repeat
        self._entry: Any = None
        self._cancelled = False

    def arm(self) -> None:
        if not self._cancelled:
            hub, seconds, fn = self._hub, self._seconds, self._fn
            self._entry = hub.call_repeatedly(seconds, fn) if self._repeat else hub.call_later(seconds, fn)

    def cancel(self) -> None:
        self._cancelled = True
        if self._entry is not None:
            self._entry.cancel()


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
