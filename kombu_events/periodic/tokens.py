"""Periodic events on the broker: the handler of a schedule's token queue, its state queue, its seeds.

A schedule is a handler of its own token queue (``x-single-active-consumer``,
prefetch 1: one token in flight in the whole fleet), so its runs happen in the
worker's pool like any handler's. :class:`TokenHandler` is that handler: it peeks
the state, lets :func:`kombu_events.core.schedule.action_for` decide, runs the user's
function, writes the state, publishes the next token through the service's delay
ladder (confirmed), writes the state again, and returns: the consumer acks.
:class:`Seeder` publishes a seed token per schedule each time the events step
starts. docs/scheduling.md has the argument.
"""
from __future__ import annotations

__all__ = ["TokenHandler", "StateStore", "Seeder", "peek_state"]

import json
import logging
import os
import socket
import threading
import time
from dataclasses import replace
from typing import Any, Callable

from amqp import Message
from amqp.exceptions import NotFound

from .. import signals
from ..core import wire
from ..core.event import Event
from ..core.schedule import (
    MISSED_SHOWN,
    Advance,
    Begin,
    Later,
    Run,
    Schedule,
    Stale,
    State,
    Token,
    TokenAction,
    action_for,
    iso,
    next_token,
)
from ..errors import KombuEventsError, UnroutableError
from ..middleware.base import Middleware
from ..publishing.publisher import Publisher, build_message

logger = logging.getLogger(__name__)

SEED_ATTEMPTS = 5


def now_ms() -> int:
    """Wall-clock time in ms since the epoch (periods are wall-clock times: every worker must agree)."""
    return time.time_ns() // 1_000_000


def peek_state(channel: Any, queue: str, *, clean: bool = False) -> State | None:
    """The newest state in ``queue``, left in place (got, then rejected with requeue).

    There is one message unless a write raced a peek; ``clean`` acks the older ones
    (the worker does, the CLI does not). A queue that does not exist raises NotFound.
    """
    got = []
    while True:
        message = channel.basic_get(queue, no_ack=False)
        if message is None:
            break
        got.append((_parse_state(message.body), message.delivery_tag))
    got.sort(key=lambda item: _newness(item[0]))
    for index, (_state, tag) in enumerate(got):
        if index == len(got) - 1:
            channel.basic_reject(tag, requeue=True)
        elif clean:
            channel.basic_ack(tag)
        else:
            channel.basic_reject(tag, requeue=True)
    return got[-1][0] if got else None


def _parse_state(body: Any) -> State | None:
    try:
        return State.from_dict(json.loads(body))
    except ValueError as exc:  # not ours, or damaged: read as no state (the schedule begins again)
        logger.warning("kombu-events: ignored a schedule state that cannot be read: %s", exc)
        return None


def _newness(state: State | None) -> tuple[int, int, int]:
    if state is None:
        return (-2, -2, -2)
    last = -1 if state.last_run is None else state.last_run
    nxt = -1 if state.next is None else state.next
    return (last, nxt, int(state.info.get("written_ms") or 0))


def token_message(token: Token) -> Message:
    """A token as a message; logs show the schedule's name as its routing key, not the ladder's."""
    return build_message(token.as_dict(), headers={wire.ROUTING_KEY: f"schedule.{token.schedule}"})


class StateStore(Publisher):
    """The confirmed publisher of a service's schedules, which also peeks and writes their state queues."""

    def __init__(self, url: str, declare: Callable[[Any, str], None], *, app: Any = None) -> None:
        super().__init__(url, app=app)
        self._declare = declare  # (channel, state queue): declare a state queue that expired

    def peek(self, queue: str, *, recheck_s: float = 0.1) -> State | None:
        """The schedule's state, or None (none written, or its queue expired: declared again).

        An empty queue is read once more after ``recheck_s``: a ``kombu-events schedules``
        peeking at the same moment holds the state for a round trip, and "no state" would
        begin the schedule afresh.
        """
        state = self._peek(queue)
        if state is None and recheck_s:
            time.sleep(recheck_s)
            state = self._peek(queue)
        return state

    def _peek(self, queue: str) -> State | None:
        with self._lock:
            try:
                return peek_state(self._ensure().channel, queue, clean=True)
            except NotFound:
                self._drop()
            except Exception:
                self._drop()
                raise
            channel = self._ensure().channel
            self._declare(channel, queue)
            return None

    def write(self, queue: str, state: State) -> None:
        """Publish ``state`` to its queue (the newest message is the state), confirmed."""
        state = replace(state, info={**state.info, "written_ms": now_ms()})
        message = build_message(state.as_dict())
        try:
            self.send("", queue, message)
        except UnroutableError:  # the state queue expired: declare it, write again
            with self._lock:
                self._declare(self._ensure().channel, queue)
            self.send("", queue, build_message(state.as_dict()))


class TokenHandler:
    """The handler of a schedule's token queue: runs in the worker's pool, gets the token as an Event."""

    def __init__(self, schedules: Any, schedule: Schedule, fn: Callable[[Event], Any]) -> None:
        self.schedules = schedules
        self.schedule = schedule
        self.fn = fn
        self.__name__ = f"schedule {schedule.name}"
        self.__qualname__ = self.__name__

    def __call__(self, event: Event) -> None:
        """Handle one token; raises only when the broker fails (the token is then retried, not lost)."""
        try:
            token = Token.from_dict(event.payload)
        except ValueError as exc:
            logger.error("kombu-events: dropped a message of %s that is no token: %s", self.schedule.queue, exc)
            return
        store = self.schedules.store
        state = store.peek(self.schedule.state_queue)
        decision: TokenAction = action_for(self.schedule, token, state, now_ms())
        if isinstance(decision, Begin):
            state = decision.state(self.schedule)
            store.write(self.schedule.state_queue, state)
            decision = action_for(self.schedule, token, state, now_ms())
        self._carry_out(decision, state, event, store)

    def _carry_out(self, decision: TokenAction, state: State | None, event: Event, store: StateStore) -> None:
        s = self.schedule
        if isinstance(decision, Stale):
            logger.debug("kombu-events: schedule %s: stale token: %s", s.name, decision.reason)
        elif isinstance(decision, Later):
            self._publish_token(store, decision)
        elif isinstance(decision, Advance):
            nxt = next_token(s, decision.last_run, now_ms())
            self._publish_token(store, nxt)
            info = state.info if state is not None else {}
            store.write(s.state_queue, State(decision.last_run, s.due_ms(decision.last_run), nxt.period,
                                             s.signature, info))
        elif isinstance(decision, Run):
            self._run(decision, event, store)

    def _run(self, run: Run, token_event: Event, store: StateStore) -> None:
        s = self.schedule
        info = self._call(run, token_event)
        state = State(run.target, run.due_ms, run.previous_next, s.signature, info)
        store.write(s.state_queue, state)  # from here on, a crash does not run this period again
        nxt = next_token(s, run.target, now_ms())
        self._publish_token(store, nxt)  # from here on, a crash does not lose the next period
        store.write(s.state_queue, replace(state, next=nxt.period))

    def _call(self, run: Run, token_event: Event) -> dict[str, Any]:
        """Call the user's function for ``run``; what the state records about it (it never raises)."""
        s = self.schedule
        missed = run.missed
        payload = {"schedule": s.name, "period": run.target, "due": iso(run.due_ms),
                   "missed": list(missed[:MISSED_SHOWN]), "missed_count": len(missed)}
        event = Event(payload, s.name, s.queue, token_event.attempt, dict(token_event.headers),
                      dict(token_event.properties), json.dumps(payload).encode())
        started, began = now_ms(), time.perf_counter()
        outcome = "ok"
        try:
            self.fn(event)
        except Exception as exc:  # the schedule goes on: reported, recorded, never retried or archived
            duration_ms = (time.perf_counter() - began) * 1000
            outcome = f"failed: {type(exc).__name__}: {exc}"[:500]
            logger.exception("kombu-events: schedule %s period %s failed; the schedule goes on", s.name, run.target)
            if signals.handler_failed.receivers:
                signals.handler_failed.send(sender=self.fn, event=event, exception=exc,
                                            traceback=exc.__traceback__, duration_ms=duration_ms)
        return {"ran_at": iso(started), "duration_ms": round((time.perf_counter() - began) * 1000, 1),
                "outcome": outcome, "missed_count": len(missed), "worker": f"{socket.gethostname()}:{os.getpid()}"}

    def _publish_token(self, store: StateStore, later: Later) -> None:
        """Publish the token of ``later.period`` through the ladder; beyond its reach, as far as it goes."""
        s = self.schedule
        topology = self.schedules.topology
        delay_ms = min(later.delay_ms, topology.settings.max_delay_ms)  # it hops: early tokens wait again
        address = topology.address(s.queue, delay_ms)
        store.send(address.exchange, address.routing_key, token_message(Token(s.name, later.period, s.signature)))


class Seeder(Middleware):
    """Publishes a seed token per schedule each time the events step starts (duplicates are harmless)."""

    def __init__(self, schedules: Any) -> None:
        self.schedules = schedules

    def started(self, control: Any) -> None:
        """Seed from a thread: confirms are awaited on a connection of its own, never on the event loop."""
        if self.schedules.all:
            threading.Thread(target=self._seed_logged, daemon=True, name="kombu-events-seed").start()

    def _seed_logged(self) -> None:
        """The seeding thread's body: what goes wrong is logged here (a thread's exception reaches stderr only)."""
        try:
            if not self.seed():
                logger.error("kombu-events: gave up seeding the schedules of %s; a schedule with no token in "
                             "flight waits for the next start of the events step", self.schedules.service)
        except Exception:
            logger.exception("kombu-events: seeding the schedules of %s failed; a schedule with no token in "
                             "flight waits for the next start of the events step", self.schedules.service)

    def seed(self, *, attempts: int = SEED_ATTEMPTS, pause_s: float = 1.0) -> bool:
        """Publish the seeds (confirmed), trying ``attempts`` times; whether they were published."""
        topology = self.schedules.topology
        items = []
        for s in self.schedules.all:
            address = topology.address(s.queue, 0)
            items.append((address.exchange, address.routing_key, token_message(Token(s.name, None, s.signature))))
        for attempt in range(1, attempts + 1):
            try:
                errors = [e for e in self.schedules.store.send_many(items) if e is not None]
                if not errors:
                    return True
                raise errors[0]
            except KombuEventsError as exc:
                logger.warning("kombu-events: seeding the schedules of %s failed (attempt %d of %d): %s",
                               self.schedules.service, attempt, attempts, exc)
                time.sleep(pause_s * attempt)
        return False
