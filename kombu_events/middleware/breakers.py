"""``Breakers``: the middleware that gives handlers circuit breakers, driving
:class:`~kombu_events.core.breaker.Breaker` (the publisher's breakers are :mod:`kombu_events.publishing.breakers`).

One circuit (:class:`Circuit`: its breaker, and what the middleware keeps about it) per handler queue
with a ``circuit_breaker``. Failures that would be
retried (the handler raised, or its pool process was lost) are counted; at the
threshold the circuit opens and the queue is paused through the service's
:class:`~kombu_events.middleware.control.Control` (its consumer is cancelled: messages wait in
the broker, no attempt spent). After the reset time the handler's health checks run
(in threads); unless one says Unhealthy the circuit half-opens and the queue is
consumed one message at a time: that message is the probe. Its success closes the
circuit (back to the service's prefetch), its failure opens it again for longer.

A message that still arrives while the circuit is open (the broker may push some
before it confirms the cancel), or beyond the probe while half-open, is deferred:
sent back to its queue through the delay ladder without spending an attempt and
without counting as a redelivery. Messages already handed to the pool when it trips
are deferred there (:meth:`Breakers.admit`, through memory shared before the pool
forked), unless their handler had started: those finish and settle as usual, and
their failures are not counted again.

Why nothing is redelivered by a pause: py-amqp's ``basic_cancel`` waits for the
broker's CancelOk and keeps the consumer's callback until then, so whatever the broker
sent before it reaches :meth:`Breakers.before_dispatch` (and is deferred); after
CancelOk the broker sends nothing more for that consumer tag, so py-amqp's
reject-with-requeue of a delivery for an unknown tag (which would mark it redelivered)
never happens. The breaker's state changes before the cancel is sent, since the
messages arriving meanwhile are dispatched from inside that call.
"""
from __future__ import annotations

__all__ = ["Breakers"]

import ctypes
import logging
import time
from functools import partial
from multiprocessing.sharedctypes import RawArray
from typing import TYPE_CHECKING, Callable, Iterable

from .. import signals
from ..core.breaker import CLOSED, HALF_OPEN, OPEN, Breaker
from ..core.decision import DEFERRED, FAILED, LOST, OK, Outcome
from ..core.health import Health, HealthCheck, Unhealthy
from ..core.logs import escape_controls
from ..errors import ConfigurationError
from .base import Middleware
from .health import HealthRun, Spawn

if TYPE_CHECKING:
    from ..core.delivery import Delivery
    from ..core.handlers import Handler
    from ..core.settlement import Step
    from .control import Control, Timer

logger = logging.getLogger(__name__)

#: Outcome kinds a breaker counts as failures: what would be retried, not what is archived.
COUNTED = frozenset({FAILED, LOST})


class Circuit:
    """The breaker of one handler queue and what the middleware keeps about it."""

    def __init__(self, handler: Handler) -> None:
        assert handler.circuit_breaker is not None
        self.handler = handler
        self.queue = handler.queue
        self.breaker = Breaker(handler.circuit_breaker, name=handler.name)
        self.runs: list[HealthRun] = []
        #: The delivery let through as the probe while half-open (compared by identity).
        self.probe: Delivery | None = None
        #: Health runs whose results the circuit waits for before it half-opens.
        self.awaiting: set[HealthRun] = set()
        self.timer: Timer | None = None
        #: [1.0 while open, when it half-opens]: made before the pool forks, so pool processes read what
        #: the main process writes (:meth:`Breakers.admit`).
        self.gate = RawArray(ctypes.c_double, 2)

    def share(self) -> None:
        """Publish the circuit's state to the pool processes."""
        breaker = self.breaker
        self.gate[1] = breaker.reopens_at or 0.0
        self.gate[0] = 1.0 if breaker.state == OPEN else 0.0


class Breakers(Middleware):
    """Circuit breakers of a service's handlers (added by ``Events`` when a handler has one).

    ``clock`` and ``spawn`` (runs a health check's thread body) are for tests.
    """

    def __init__(self, handlers: Iterable[Handler], checks: Iterable[HealthCheck] = (), *, prefetch_count: int,
                 max_delay_ms: float, clock: Callable[[], float] = time.monotonic,
                 spawn: Spawn | None = None) -> None:
        self.circuits = {h.queue: Circuit(h) for h in handlers if h.circuit_breaker is not None}
        self.prefetch_count = prefetch_count
        self.max_delay_ms = max_delay_ms
        self.clock = clock
        self.control: Control | None = None
        self.runs = [HealthRun(check, self._health, spawn=spawn) for check in checks]
        by_fn = {c.handler.fn: c for c in self.circuits.values()}
        for run in self.runs:
            for fn in run.check.handlers:
                if fn not in by_fn:
                    raise ConfigurationError(f"health check {run.check.name!r} checks {fn!r}, which is not a "
                                             "handler with a circuit breaker (give it circuit_breaker=...)")
                by_fn[fn].runs.append(run)

    # -- the worker's step ------------------------------------------------------------------------

    def started(self, control: Control) -> None:
        """Set the health-check timers; re-arm open circuits; re-probe a circuit that was half-open."""
        self.control = control
        for run in self.runs:
            run.attach(control)
            control.call_every(run.check.interval_s, run.request)
        for circuit in self.circuits.values():
            _guarded(circuit, "re-arming it after the step started", partial(self._rearm, circuit, control))

    def _rearm(self, circuit: Circuit, control: Control) -> None:
        """An open circuit waits out its reset time; a half-open one probes again."""
        if circuit.breaker.state == OPEN:
            self._schedule(circuit)
        elif circuit.breaker.state == HALF_OPEN:  # the probe died with the old connection
            circuit.probe = None
            circuit.breaker.release()
            control.resume(circuit.queue, prefetch=1)

    def stopped(self, control: Control) -> None:
        """The step stopped: its timers are gone; results still to come are taken as they arrive."""
        for circuit in self.circuits.values():
            circuit.timer = None
            circuit.awaiting.clear()

    # -- messages ---------------------------------------------------------------------------------

    def before_dispatch(self, delivery: Delivery) -> Outcome | None:
        """Let a message through a closed circuit, or as the probe of a half-open one; defer the rest."""
        circuit = self.circuits.get(delivery.queue)
        if circuit is None or self.control is None or circuit.breaker.state == CLOSED:
            return None
        breaker, now = circuit.breaker, self.clock()
        if breaker.state == HALF_OPEN and breaker.allow(now):
            circuit.probe = delivery
            return None
        # back about when the circuit half-opens; beyond a half-open circuit's probe, after one reset time
        if breaker.state == OPEN and breaker.reopens_at is not None:
            wait_s = breaker.reopens_at - now
        else:
            wait_s = breaker.policy.reset_s
        delay_ms = min(max(wait_s, 0.0) * 1000, self.max_delay_ms)
        return Outcome(DEFERRED, f"circuit {breaker.state}: {breaker.reason}", delay_ms=delay_ms)

    def admit(self, queue: str) -> Outcome | None:
        """Pool side: defer a message handed to the pool before its circuit opened, instead of running it.

        Up to ``prefetch_count`` messages may be in the pool when a circuit trips; without
        this, each would call the broken dependency and spend an attempt.
        """
        circuit = self.circuits.get(queue)
        if circuit is None or not circuit.gate[0]:
            return None
        wait_s = max(circuit.gate[1] - self.clock(), 0.0)  # CLOCK_MONOTONIC is one clock for every process
        return Outcome(DEFERRED, "circuit open (the message reached the pool before it opened)",
                       delay_ms=min(wait_s * 1000, self.max_delay_ms))

    def settled(self, delivery: Delivery, outcome: Outcome, step: Step) -> None:
        """Count a failure of a closed circuit; take a half-open circuit's result from its probe."""
        circuit = self.circuits.get(delivery.queue)
        if circuit is None or self.control is None:
            return
        breaker, now = circuit.breaker, self.clock()
        if breaker.state == CLOSED and outcome.kind in COUNTED:
            self._changed(circuit, CLOSED, breaker.failure(now), now, f" (last failure: {outcome.reason})")
        elif breaker.state == HALF_OPEN and delivery is circuit.probe:
            circuit.probe = None
            if outcome.kind == OK:
                self._changed(circuit, HALF_OPEN, breaker.success(now), now)
            elif outcome.kind in COUNTED:
                self._changed(circuit, HALF_OPEN, breaker.failure(now, f"the probe failed: {outcome.reason}"), now)
            else:  # not run, archived, Retry: says nothing about the dependency; the next message probes
                breaker.release()

    # -- transitions ------------------------------------------------------------------------------

    def _changed(self, circuit: Circuit, previous: str, state: str | None, now: float, detail: str = "") -> None:
        """Log, signal and act on a transition (the breaker is already in its new state)."""
        if state is None or self.control is None:
            return
        circuit.share()
        _log(circuit, state, now, detail)
        if signals.circuit_changed.receivers:
            signals.circuit_changed.send(sender=circuit.handler.fn, queue=circuit.queue, state=state,
                                         previous=previous, reason=circuit.breaker.reason or "the probe succeeded")
        _guarded(circuit, "pausing or resuming its queue", partial(self._act, circuit, state, self.control))

    def _act(self, circuit: Circuit, state: str, control: Control) -> None:
        """Pause the queue of a circuit that opened, consume it one at a time half-open, as before closed."""
        if state == OPEN:
            circuit.probe = None
            control.pause(circuit.queue, f"circuit open: {circuit.breaker.reason}")
            self._schedule(circuit)
        elif state == HALF_OPEN:
            control.resume(circuit.queue, prefetch=1)
        else:
            self._cancel_timer(circuit)
            # Back to the handler's own prefetch (handler(prefetch=...)), else the service's.
            control.resume(circuit.queue, prefetch=circuit.handler.prefetch or self.prefetch_count)

    def _schedule(self, circuit: Circuit) -> None:
        """Wake up when the open circuit's reset time comes."""
        circuit.share()  # an Unhealthy check may have pushed the reset time back
        self._cancel_timer(circuit)
        if self.control is not None and circuit.breaker.reopens_at is not None:
            wait_s = max(0.0, circuit.breaker.reopens_at - self.clock())
            circuit.timer = self.control.call_after(wait_s, partial(_guarded, circuit, "its reset timer",
                                                                    partial(self._reset_due, circuit)))

    def _cancel_timer(self, circuit: Circuit) -> None:
        if circuit.timer is not None:
            circuit.timer.cancel()
            circuit.timer = None

    def _reset_due(self, circuit: Circuit) -> None:
        """The reset time came: run the health checks first, if any, else half-open now."""
        circuit.timer = None
        breaker = circuit.breaker
        if breaker.state != OPEN:
            return
        if not breaker.due(self.clock()):
            self._schedule(circuit)
        elif circuit.runs:
            circuit.awaiting = set(circuit.runs)
            for run in circuit.runs:
                run.request()
        else:
            self._changed(circuit, OPEN, breaker.half_open(self.clock()), self.clock())

    # -- health checks ------------------------------------------------------------------------------

    def _health(self, run: HealthRun, health: Health) -> None:
        """A health check's result (on the event loop), for the circuit of each handler it serves."""
        for circuit in self.circuits.values():
            if run not in circuit.runs:
                continue
            if circuit.breaker.state == OPEN:
                self._before_probe(circuit, run, health)
            else:
                previous = circuit.breaker.state
                state = circuit.breaker.health(health.status, self.clock(), _why(run, health))
                self._changed(circuit, previous, state, self.clock())

    def _before_probe(self, circuit: Circuit, run: HealthRun, health: Health) -> None:
        """An open circuit takes only the results it waits for: Unhealthy keeps it open for longer."""
        if run not in circuit.awaiting:
            return  # between probes, an open circuit's reset time is not pushed back by every check
        now = self.clock()
        if isinstance(health, Unhealthy):
            circuit.awaiting.clear()
            circuit.breaker.health(health.status, now, _why(run, health))
            logger.info("kombu-events: circuit of handler %s (queue %s) stays open: %s; next probe in %.3g s",
                        circuit.handler.name, circuit.queue, escape_controls(circuit.breaker.reason),
                        (circuit.breaker.reopens_at or now) - now)
            self._schedule(circuit)
            return
        circuit.awaiting.discard(run)
        if not circuit.awaiting:
            self._changed(circuit, OPEN, circuit.breaker.half_open(now), now)


def _guarded(circuit: Circuit, what: str, action: Callable[[], None]) -> None:
    """``action()``; an exception is logged with its circuit, and goes no further (the event loop goes on)."""
    try:
        action()
    except Exception:
        logger.exception("kombu-events: circuit of handler %s (queue %s, %s): %s failed", circuit.handler.name,
                         circuit.queue, circuit.breaker.state, what)


def _why(run: HealthRun, health: Health) -> str:
    return f"health check {run.check.name}: {health.status}" + (f": {health.reason}" if health.reason else "")


def _log(circuit: Circuit, state: str, now: float, detail: str) -> None:
    """One line per transition: a trip at warning (error while trips come too often), others at info."""
    breaker, name, queue = circuit.breaker, circuit.handler.name, circuit.queue
    if state == OPEN:
        level = logging.ERROR if breaker.log_level(now) == "error" else logging.WARNING
        logger.log(level, "kombu-events: circuit of handler %s (queue %s) opened: %s%s; queue paused, "
                   "half-opens in %.3g s (trip %d in a row)", name, queue, escape_controls(breaker.reason),
                   escape_controls(detail),
                   (breaker.reopens_at or now) - now, breaker.trips_in_a_row)
    elif state == HALF_OPEN:
        logger.info("kombu-events: circuit of handler %s (queue %s) half-open: one probe message", name, queue)
    else:
        logger.info("kombu-events: circuit of handler %s (queue %s) closed: the probe succeeded", name, queue)

