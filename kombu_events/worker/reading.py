"""A reader of a log inside a worker (``@events.reader``, docs/logs.md): the fleet's lock, the position, rewinds.

One :class:`ReaderState` per reader of a service (:class:`Readers`, on the worker's event loop). It takes the
reader's lock (the only exclusive consumer of ``<service>.reader.<name>``, on a channel of its own; a worker
refused waits and asks again every :data:`LOCK_RETRY_S`), reads the position (one message of
``<name>.position``, got and put back: a classic queue, so nothing is counted) and consumes the log's stream
from there on the same channel (:data:`PREFETCH` ahead). Each event goes through the
:class:`~kombu_events.worker.consumer.ServiceConsumer`'s screening, hand-off to the pool and settling, as a
handler's, one at a time: the next goes once the one before is acked (the others wait here, in order), a
failure held in place (its retries run before the next event).

Each event acked moves the position on; it is written (confirmed) every :data:`~kombu_events.core.readers.
COMMIT_EVERY` events or :data:`~kombu_events.core.readers.COMMIT_MS`, and when the worker stops. A worker
killed between two writes leaves the events handled since the last one to be handled again: at least once.

A rewind (``kombu-events log rewind``) is a message in the lock queue, so it reaches the worker that holds
the lock (or the next one): the stream's consumer starts again at its offset, the position (with its
generation counted up) is written, and the request is acked once the broker confirmed that write. An event
acked after the rewind that was received before it moves nothing.
"""
from __future__ import annotations

__all__ = ["Readers", "ReaderState", "LOCK_RETRY_S", "PREFETCH"]

import logging
import threading
import time
from collections import deque
from functools import partial
from typing import Any, Callable

from amqp import Message
from amqp.exceptions import AccessRefused, NotFound
from kombu import Queue

from ..broker.eager_consumer import EagerConsumer
from ..broker.streams import OFFSET_HEADER, close_quietly
from ..broker.waits import answer_within
from ..core.readers import (
    COMMIT_EVERY,
    COMMIT_MS,
    GENERATION_HEADER,
    POSITION_HEADER,
    Position,
    Reader,
    Rewind,
    stream_offset,
)
from ..registry import Route
from .published import prepare

logger = logging.getLogger(__name__)

#: A worker refused the lock (another reads) asks again this often; the timer also writes the position.
LOCK_RETRY_S = 5.0
#: What the timer of a reader runs at: writes the position when due, checks the lock, retries it.
TICK_S = COMMIT_MS / 1000 / 2
#: Events of the stream the broker sends ahead of the one with the pool (they wait here, in order).
PREFETCH = 100


class Readers:
    """The readers of one service in a worker, as its ServiceConsumer drives them (it hands each event over with
    ``dispatch(route, message)``; the Settler says which it acked)."""

    def __init__(self, routes: list[Route], mailbox: Any, settler: Any, *,
                 dispatch: Callable[[Route, Any], None]) -> None:
        self.mailbox = mailbox
        service = settler.topology.settings.service
        self.states = {r.handler.queue: ReaderState(r, service=service, post=mailbox.post,
                                                    confirmer=lambda: settler.confirmer,
                                                    dispatch=partial(dispatch, r))
                       for r in routes if r.handler.reader is not None}
        if self.states:
            settler.acked = self.acked
        self._timer: Any = None

    def attach(self, connection: Any) -> None:
        """A new connection (or the same, the step restarted): what was held on the old one is gone."""
        for state in self.states.values():
            state.release()
            state.attach(connection)

    def start(self, hub: Any) -> None:
        """Each reader tries its lock now, then on a timer (the hub's; without one, a thread's, on the loop)."""
        if not self.states:
            return
        self.tick()
        if hub is not None:
            self._timer = hub.call_repeatedly(TICK_S, self.tick)
        else:
            self._timer = _Repeat(TICK_S, lambda: self.mailbox.post(self.tick))

    def tick(self) -> None:
        for state in self.states.values():
            state.tick()

    def stop(self) -> None:
        """Receive no more (the events with the pool still settle): timers and stream consumers cancelled."""
        if self._timer is not None:
            _quietly(self._timer.cancel)
            self._timer = None
        for state in self.states.values():
            state.stop_reading()

    def commit(self) -> None:
        """Write each held reader's position (at shutdown, before the confirms are waited for)."""
        for state in self.states.values():
            if state.holding:
                _quietly(state.commit)

    def release(self) -> None:
        for state in self.states.values():
            state.release()

    def acked(self, route: Route, message: Any) -> None:
        """The Settler acked ``message`` (any handler's): a reader's position moves past it."""
        state = self.states.get(route.handler.queue) if route.handler.reader is not None else None
        if state is not None:
            state.acked(message)


class ReaderState:
    """One reader of a log in this worker: holding its lock or waiting for it, and its position."""

    def __init__(self, route: Route, *, service: str, post: Callable[[Callable[[], Any]], None],
                 confirmer: Callable[[], Any], dispatch: Callable[[Any], None]) -> None:
        assert route.handler.reader is not None
        self.route = route
        self.reader: Reader = route.handler.reader
        self.service = service
        #: Run a callable on the event loop once the callback running now has returned.
        self._post = post
        #: The publisher channel's Confirmer, or None (no channel now).
        self._confirmer = confirmer
        #: Hand an event to the pool (screened, then the hand-off: the ServiceConsumer's).
        self._dispatch = dispatch
        #: The stream's consumer (on the lock's channel), while reading.
        self.consumer: Any = None
        #: Events the broker sent ahead (a stream sends what its chunk holds, beyond the prefetch), in order.
        self.pending: deque[Any] = deque()
        #: The event with the pool (or held for a retry), None: the next waits until it is acked.
        self.in_flight: Any = None
        self.connection: Any = None
        self.channel: Any = None
        self.holding = False
        self.generation = 0
        #: The next offset to read, once an event was acked or a position read (None: from the reader's start).
        self.next_offset: int | None = None
        self.committed: int | None = None
        self._acked_since = 0
        self._since = 0.0
        self._tried = 0.0
        #: id(message) -> the generation it was received in, for the events sent to the pool and not acked.
        self._generation_of: dict[int, int] = {}

    # -- the lock --------------------------------------------------------------------------------

    def attach(self, connection: Any) -> None:
        """A new connection: nothing held (the old one's lock went with it)."""
        self.connection, self.channel, self.holding = connection, None, False
        self._generation_of.clear()
        self.pending.clear()  # the old connection's: the broker sends them again from the position
        self.in_flight = None
        self._tried = 0.0

    def tick(self) -> None:
        """Timer, on the event loop: write the position when due; lost the lock: stop; not holding: try it."""
        try:
            if self.holding and not getattr(self.channel, "is_open", False):
                logger.warning("kombu-events: reader %s of service %s lost its lock (its channel was closed); "
                               "it stops here and waits for it", self.reader.name, self.service)
                self.release()
            if self.holding:
                if self._acked_since and time.monotonic() - self._since >= COMMIT_MS / 1000:
                    self.commit()
            elif time.monotonic() - self._tried >= LOCK_RETRY_S and self.connection is not None:
                with answer_within(self.connection, doing=f"taking the lock of reader {self.reader.name}"):
                    self.try_lock()
        except Exception:  # never into the hub
            logger.exception("kombu-events: reader %s of service %s: its timer failed", self.reader.name,
                             self.service)

    def try_lock(self) -> bool:
        """Take the lock if nobody holds it; then read the position and start reading the stream."""
        self._tried = time.monotonic()
        channel = self.connection.channel()
        try:
            channel.basic_qos(0, 10, False)
            channel.basic_consume(self.reader.queue, no_ack=False, exclusive=True, callback=self._on_request)
        except AccessRefused:  # another worker reads: this one waits
            close_quietly(channel)
            logger.debug("kombu-events: reader %s of service %s is read by another worker", self.reader.name,
                         self.service)
            return False
        except NotFound:
            close_quietly(channel)
            logger.error("kombu-events: the queue %s of reader %s is missing: run `kombu-events declare`",
                         self.reader.queue, self.reader.name)
            return False
        except BaseException:
            close_quietly(channel)
            raise
        prepare(channel)  # bodies as published, as the handlers' channel gives them
        self.channel, self.holding = channel, True
        self.in_flight = None  # an event of an earlier holding that is still with the pool moves nothing now
        self._generation_of.clear()
        position = self._read_position()
        start: Any
        if position is None:
            start, self.generation, self.next_offset = stream_offset(self.reader.start), 0, None
        else:
            start, self.generation, self.next_offset = position.offset, position.generation, position.offset
        self.committed = self.next_offset
        self._acked_since = 0
        logger.info("kombu-events: reader %s of service %s reads %s from %s", self.reader.name, self.service,
                    self.reader.log.queue, start if position is not None else f"{self.reader.start} (no position)")
        self._read_from(start)
        return True

    def _read_position(self) -> Position | None:
        got = self.channel.basic_get(self.reader.position_queue, no_ack=False)
        if got is None:
            return None
        try:
            return Position.parse(got.body)
        except ValueError as exc:
            logger.warning("kombu-events: reader %s of service %s: its position cannot be read (%s); it starts "
                           "at %s", self.reader.name, self.service, exc, self.reader.start)
            return None
        finally:
            self.channel.basic_reject(got.delivery_tag, requeue=True)

    def _read_from(self, start: Any) -> None:
        """Consume the log's stream from ``start`` on the lock's channel (the last consumer cancelled first)."""
        self.stop_reading()
        self.channel.basic_qos(0, PREFETCH, False)
        stream = Queue(self.reader.log.queue, no_declare=True, consumer_arguments={OFFSET_HEADER: start})
        self.consumer = EagerConsumer(self.channel, queues=[stream], no_ack=False, auto_declare=False,
                                      on_message=self.received, on_decode_error=lambda m, exc: self.received(m))
        self.consumer.consume()

    def stop_reading(self) -> None:
        """Cancel the stream's consumer (what it sent and is not with the pool is dropped: never acked, never run)."""
        consumer, self.consumer = self.consumer, None
        self.pending.clear()
        if consumer is not None and getattr(self.channel, "is_open", False):
            _quietly(consumer.cancel)

    def release(self) -> None:
        """Stop reading and give the lock back (the lock's channel closed: the broker drops its consumers)."""
        self.stop_reading()
        self.holding = False
        if self.channel is not None:
            close_quietly(self.channel)
            self.channel = None

    # -- the position ----------------------------------------------------------------------------

    def received(self, message: Any) -> None:
        """kombu callback: an event of the stream arrived; to the pool once the one before is acked."""
        if self.consumer is None:
            return  # sent before the cancel: dropped (a stream's ack is only credit)
        try:
            self._generation_of[id(message)] = self.generation
            headers = message.properties.get("application_headers")
            if isinstance(headers, dict):  # the handler's event says which reading it belongs to (once=True's key)
                headers[GENERATION_HEADER] = self.generation
            self.pending.append(message)
            self._next()
        except Exception:  # never into kombu: the reader stops here until its lock is taken again
            logger.exception("kombu-events: reader %s of service %s could not take an event", self.reader.name,
                             self.service)

    def _next(self) -> None:
        if self.in_flight is None and self.pending:
            self.in_flight = self.pending[0]
            self._dispatch(self.pending.popleft())

    def acked(self, message: Any) -> None:
        """An event was acked: the position moves past it (unless a rewind came in between)."""
        generation = self._generation_of.pop(id(message), None)
        if message is self.in_flight:
            self.in_flight = None
            self._post(self._next)  # on the event loop, once this settling (maybe inside a confirm) is done
        if generation != self.generation or not self.holding:
            return
        offset = int((message.headers or {})[OFFSET_HEADER])
        self.next_offset = offset + 1
        if not self._acked_since:
            self._since = time.monotonic()
        self._acked_since += 1
        if self._acked_since >= COMMIT_EVERY:
            self.commit()

    def commit(self, on_ok: Callable[[], Any] | None = None) -> None:
        """Write the position (persistent, confirmed; the queue keeps the newest)."""
        confirmer = self._confirmer()
        if confirmer is None or self.next_offset is None:
            return
        position = Position(self.next_offset, self.generation)
        self._acked_since = 0
        body = position.body(reader=self.reader.name, stream=self.reader.log.queue)
        message = Message(body, content_type="application/json", delivery_mode=2,
                          application_headers={POSITION_HEADER: self.reader.name})

        def written() -> None:
            self.committed = position.offset if self.generation == position.generation else self.committed
            if on_ok is not None:
                on_ok()

        def failed(why: str) -> None:
            logger.warning("kombu-events: reader %s of service %s: writing its position %d failed (%s); written "
                           "again later", self.reader.name, self.service, position.offset, why)
            self._acked_since = max(1, self._acked_since)

        confirmer.publish(message, "", self.reader.position_queue, written, failed)

    # -- rewinds ---------------------------------------------------------------------------------

    def _on_request(self, message: Any) -> None:
        """py-amqp callback (inside its frame dispatch): a rewind for this reader; applied on the event loop."""
        try:
            self._post(lambda: self._rewind(message))
        except Exception:
            logger.exception("kombu-events: reader %s of service %s: a rewind request could not be taken; it "
                             "stays in %s", self.reader.name, self.service, self.reader.queue)

    def _rewind(self, message: Any) -> None:
        try:
            request = Rewind.parse(message.body)
        except ValueError as exc:
            logger.warning("kombu-events: reader %s of service %s: dropped a message of %s that is not a rewind "
                           "request (%s)", self.reader.name, self.service, self.reader.queue, exc)
            self._ack_request(message)
            return
        if not self.holding or message.channel is not self.channel:
            return  # the lock went meanwhile: the request is the next holder's
        before = self.next_offset
        self.generation += 1
        self.next_offset = request.offset
        self._read_from(request.offset)  # what was sent ahead is dropped; the event with the pool finishes
        logger.warning("kombu-events: reader %s of service %s rewound from offset %s to %d (%s)", self.reader.name,
                       self.service, before if before is not None else "(its start)", request.offset,
                       request.asked or "asked")
        self.commit(on_ok=lambda: self._ack_request(message))

    def _ack_request(self, message: Any) -> None:
        try:
            if message.channel is self.channel and getattr(self.channel, "is_open", False):
                self.channel.basic_ack(message.delivery_tag)
        except Exception as exc:  # the lock went: the request is the next holder's again
            logger.debug("kombu-events: acking a rewind request failed: %s", exc)


class _Repeat:
    """``fn`` every ``interval_s`` on a daemon thread, until cancelled (a worker without an event loop)."""

    def __init__(self, interval_s: float, fn: Callable[[], Any]) -> None:
        self._stop = threading.Event()
        threading.Thread(target=self._run, args=(interval_s, fn), daemon=True, name="kombu-events-readers").start()

    def _run(self, interval_s: float, fn: Callable[[], Any]) -> None:
        while not self._stop.wait(interval_s):
            try:
                fn()
            except Exception:  # the mailbox closed at shutdown
                return

    def cancel(self) -> None:
        self._stop.set()


def _quietly(fn: Callable[[], Any]) -> None:
    try:
        fn()
    except Exception as exc:  # the channel or the connection went meanwhile
        logger.debug("kombu-events: %s failed: %s", getattr(fn, "__name__", fn), exc)
