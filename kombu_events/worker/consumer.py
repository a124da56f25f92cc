"""Consume one service's handler queues inside a worker: the channels' life, and receiving.

Glue, on the worker's event loop: :func:`~kombu_events.core.delivery.read_delivery` reads a
message and :func:`~kombu_events.worker.screening.screen` looks at it; a
:class:`~kombu_events.worker.handoff.Handoff` takes it to the pool with what one read of the loop
brings and back; a :class:`~kombu_events.worker.settling.Settler` plans and carries out its settling;
a :class:`~kombu_events.worker.throttle.Throttle` keeps the bodies held within the service's
``inflight_max_bytes``, stopping the consumers while it is spent.

Every method that kombu, py-amqp, the pool or the hub calls logs what went wrong and
returns: an exception escaping into Celery's event loop ends the worker. An effect
on the connection asked for from inside one of them (a breaker pausing a queue from
a ``settled`` hook, which runs inside a confirm) goes to a
:class:`~kombu_events.worker.mailbox.Mailbox`, run on the event loop once the callback
has returned.
"""
from __future__ import annotations

__all__ = ["ServiceConsumer"]

import logging
import time
from functools import partial
from typing import Any, Callable

from celery.exceptions import WorkerShutdown
from kombu import Consumer

from ..broker import verify
from ..broker.confirms import Confirmer
from ..broker.declare import declare
from ..broker.eager_consumer import EagerConsumer
from ..broker.partitions import check_partitions
from ..broker.version import QUORUM_QUEUES, require
from ..broker.waits import BrokerSilent, answer_within, call_within
from ..core.delivery import read_delivery
from ..middleware.control import Control
from ..registry import EventsService, Route
from . import awaiting
from .acks import Acks
from .handoff import Handoff, Received, item_of
from .inflight import InflightBudget
from .mailbox import Mailbox
from .published import message_id, prepare
from .reading import Readers
from .screening import screen
from .settling import Settler, quietly
from .throttle import Throttle

logger = logging.getLogger(__name__)

#: How often the event loop looks for a channel of ours that the broker closed.
CHANNEL_CHECK_S = 5.0


class ServiceConsumer:
    """The consumers of one :class:`~kombu_events.Events` service on a worker connection."""

    def __init__(self, events: EventsService, *, declare_command: str = "kombu-events -A APP declare") -> None:
        self.events = events
        self.settings = settings = events.settings
        #: What creates the topology when this worker does not declare it (``declare=False``), for its error.
        self.declare_command = declare_command
        self.routes: tuple[Route, ...] = tuple(r for r in events.routes() if not r.handler.reader)  # validated
        self.hooks = events.hooks
        self.topology = events.topology()
        self._queues = {q.name: q for q in self.topology.handler_queues}
        #: Handlers with a prefetch of their own (e.g. 1 for a periodic schedule's token queue).
        self._prefetch = {r.handler.queue: r.handler.prefetch for r in self.routes if r.handler.prefetch is not None}
        self.prefetch_count: int = events.prefetch_count
        #: Queues whose handlers are ``async def`` (awaited in the pool: never under gevent or eventlet).
        self.awaited = frozenset(r.handler.queue for r in self.routes if r.awaits)
        #: Pause/resume and timers for middleware (the same object across reconnects).
        self.control = Control(settings.service, tuple(r.handler.queue for r in self.routes), self)
        self.mailbox = Mailbox(settings.service)
        #: Bodies received and not settled, against ``inflight_max_bytes`` (counted anew on each connection).
        self.budget = InflightBudget(max_bytes=settings.inflight_max_bytes, body_bytes=settings.max_body_bytes,
                                     consumers=len(self.routes))
        self.throttle = Throttle(self.budget, self.mailbox, service=settings.service, stop=self._stop_consumers,
                                 start=self._start_consumers, running=lambda: self._started)
        self.acks = Acks(self.mailbox)  # the acks of the consumers' channel, sent together
        self.settler = Settler(topology=self.topology, hooks=self.hooks, control=self.control, acks=self.acks,
                               traceback_limit=settings.traceback_limit, release=self.throttle.release)
        self.handoff = Handoff(settings.service, awaited=self.awaited, async_concurrency=settings.async_concurrency,
                               mailbox=self.mailbox, settler=self.settler,
                               limits={r.handler.queue: r.handler.concurrency for r in self.routes
                                       if r.handler.concurrency is not None},
                               batches={r.handler.queue: (r.handler.batch.max, r.handler.batch.wait_ms)
                                        for r in self.routes if r.handler.batch is not None})
        self.settler.rerun = self.handoff.rerun  # an ordered handler's failing event, again in place
        self.readers = Readers(events.routes(), self.mailbox, self.settler, dispatch=self._dispatch_reader)
        self._consumers: dict[str, Consumer] = {}
        self._active: set[str] = set()
        self._started = False
        self._connection: Any = None
        self._channels: list[Any] = []
        self._hub: Any = None
        self._userid: str | None = None
        self._channel_check: Any = None
        #: Refusals (ACCESS_REFUSED) logged so far: one ERROR line each.
        self._refusals: set[str] = set()
        #: Handlers the pool runs at once (processes, threads or greenlets): the budget never caps a
        #: prefetch below what keeps them busy (times async_concurrency for a queue of async def handlers).
        self._concurrency = 1
        #: The prefetch each queue's consumer was last asked to start with (None: its own), for a restart.
        self._wanted: dict[str, int | None] = {}
        #: The prefetch the consumers' channel gives a consumer started now.
        self._qos = 0

    # -- lifecycle (Celery restarts the consumer blueprint on every reconnect) ---------------

    def start(self, connection: Any, pool: Any, hub: Any,
              call_soon: Callable[[Callable[[], Any]], Any] | None = None) -> None:
        """Declare the topology (with ``declare=False``: check it, passively) and start consuming on fresh
        channels of ``connection``; TopologyMissingError when a topology not declared here is not there.

        ``call_soon`` (Celery's ``Consumer.call_soon``) runs a callable between two reads of
        the blocking loop that workers without an event loop (gevent, eventlet) run.
        """
        self.readers.release()  # a lock held on this connection goes with its channel
        self._close_channels()
        self._check_pool(pool)
        # What the last connection delivered is the broker's again (redelivered): nothing held on this one.
        self.throttle.reset()
        self._wanted = {}
        self._declare(connection)
        self._hub, self._connection = hub, connection
        self.mailbox.use_call_soon(call_soon if hub is None else None)
        self._userid = self.settler.userid = getattr(connection, "userid", None)
        self._concurrency = max(1, getattr(pool, "limit", 1) or 1)
        channel = self._open_consumer_channel(connection)
        self._channels = [channel, self._open_publisher()]
        self._consumers = {
            r.handler.queue: EagerConsumer(channel, queues=[self._queues[r.handler.queue]], no_ack=False,
                                           auto_declare=False, on_message=partial(self._on_message, r),
                                           on_decode_error=partial(self._on_decode_error, r))
            for r in self.routes
        }
        self._active = set()
        # Jobs of the last connection that are still running call back into the old count, not this one.
        self.handoff.attach(connection, pool, hub,
                            in_flight=sum(self._prefetch_of(r.handler.queue, None) for r in self.routes))
        self.acks.attach(channel, hub, limit=self._qos // 2, more_to_read=self.handoff.more_to_read)  # old: dropped
        self.readers.attach(connection)
        if hub is None:
            self.consume()  # no event loop (synloop): nothing else will call consume()

    def _declare(self, connection: Any) -> None:
        """Declare the topology; with ``declare=False`` check it (on every reconnect: someone may have deleted
        a queue meanwhile)."""
        if not self.settings.declare:
            verify.check(self.topology, connection, command=self.declare_command)
            return
        if self.settings.queue_type == "quorum":
            require(connection, *QUORUM_QUEUES)
        check_partitions(self.topology, connection)  # another count over the old partitions: refused
        declare(self.topology, connection)

    def _open_consumer_channel(self, connection: Any) -> Any:
        """The channel the consumers receive on: bodies as published, a prefetch within the budget."""
        channel = connection.channel()
        prepare(channel)  # handlers get the body bytes as published, never a str
        self._qos = self.budget.prefetch(self.prefetch_count, floor=self._concurrency)
        channel.basic_qos(0, self._qos, False)
        return channel

    def _check_pool(self, pool: Any) -> None:
        """Under gevent or eventlet, refuse to start with an ``async def`` handler (exit 1, one ERROR line)."""
        if not getattr(pool, "is_green", False):
            return
        why = (f"the {type(pool).__module__.rsplit('.', 1)[-1]} pool runs handlers in greenlets, on one thread, "
               "where kombu-events cannot run an asyncio event loop for them")
        awaiting.refuse(why)  # a coroutine returned by a sync wrapper is archived with this reason
        if self.awaited:
            handlers = ", ".join(sorted(r.handler.name for r in self.routes if r.handler.queue in self.awaited))
            logger.error("kombu-events: service %s has async def handlers (%s) and %s: run this worker with "
                         "--pool=prefork, threads or solo, or define them with def", self.settings.service,
                         handlers, why)
            raise WorkerShutdown(1)

    def consume(self) -> None:
        """Start receiving; with an event loop only once the pool is registered with it."""
        if self._hub is not None:
            self.mailbox.watch(self._hub)
            self._channel_check = self._hub.call_repeatedly(CHANNEL_CHECK_S, self._check_channels)
            _ticks(self._hub).add(self._tick)
        self._started = True
        self.control.attach(self._connection, self._hub)
        if self.hooks.on_started:
            self.hooks.started(self.control)  # what it pauses or resumes is queued, and carried out
        self.mailbox.drain()  # here, before any consumer starts: a queue paused at start never gets one
        for queue in list(self._consumers):
            if queue not in self._active and not self.control.is_paused(queue):
                self._subscribe(queue, None)
        self.readers.start(self._hub)
        logger.info("kombu-events: service %s consuming %s", self.settings.service,
                    ", ".join(sorted(self._active)) or "nothing (every queue is paused)")

    def stop(self) -> None:
        """Stop receiving; keep channels so handlers still running can ack."""
        try:
            for queue, consumer in self._consumers.items():
                self._call(f"cancelling the consumer of {queue}", consumer.cancel)
        except BrokerSilent as exc:  # Celery is stopping the step already: it reconnects or ends
            logger.info("%s", exc)
        self._consumers = {}
        self._active = set()
        self.readers.stop()
        if self._hub is not None:
            _ticks(self._hub).discard(self._tick)
        self.handoff.flush()  # received already: handled and acked as if the step had not stopped
        self.acks.stop()  # no tick from now on: each ack goes at once
        if self._channel_check is not None:
            quietly(self._channel_check.cancel)
            self._channel_check = None
        if self._started:
            self._started = False
            self.control.detach()
            if self.hooks.on_stopped:
                self.hooks.stopped(self.control)

    # -- the Control's side (on the event loop) -------------------------------------------------

    def pause_queue(self, queue: str) -> None:
        """Cancel ``queue``'s consumer; prefetched messages are still handled and settled."""
        consumer = self._consumers.get(queue)
        if consumer is not None and queue in self._active:
            self._active.discard(queue)
            self._call(f"cancelling the consumer of {queue}", consumer.cancel)

    def resume_queue(self, queue: str, prefetch: int | None) -> None:
        """Consume ``queue`` again (once the step runs), with ``prefetch`` messages in flight if given."""
        consumer = self._consumers.get(queue)
        if consumer is None or not self._started:
            return  # not consuming now: consume() starts it, unless it is paused again by then
        if self.throttle.throttled:
            self._wanted[queue] = prefetch  # started with it once the budget allows
            return
        if queue in self._active:
            if prefetch is None:
                return  # a pause that never took effect: consuming already
            self._call(f"cancelling the consumer of {queue}", consumer.cancel)
        self._subscribe(queue, prefetch)

    def _subscribe(self, queue: str, prefetch: int | None) -> None:
        """Start ``queue``'s consumer with ``prefetch`` (else its handler's own, else the service's), within
        the budget."""
        consumer = self._consumers[queue]
        self._wanted[queue] = prefetch
        count = self._prefetch_of(queue, prefetch)
        channel: Any = consumer.channel
        with answer_within(self._connection, doing=f"starting the consumer of {queue}"):
            if count != self._qos:
                channel.basic_qos(0, count, False)  # applies to consumers started from now on
                self._qos = count
            consumer.consume()
            self._active.add(queue)

    def _prefetch_of(self, queue: str, prefetch: int | None) -> int:
        """The prefetch of ``queue``'s consumer started now: ``prefetch``, else its handler's, else the
        service's; at most its share of what the budget has room for."""
        wanted = self._prefetch.get(queue, self.prefetch_count) if prefetch is None else prefetch
        at_once = self._concurrency * (self.settings.async_concurrency if queue in self.awaited else 1)
        at_once = max(at_once, self.handoff.gatherer.sizes.get(queue, (0, 0))[0])  # a full batch can arrive
        return self.budget.prefetch(wanted, floor=at_once)  # any one queue may keep the whole pool busy

    def _stop_consumers(self) -> None:
        """The budget is spent: cancel every consumer (the Throttle calls it on the event loop)."""
        for queue in sorted(self._active):
            self.pause_queue(queue)

    def _start_consumers(self) -> None:
        """The budget has room again: start every consumer not paused, with the prefetch it last asked for."""
        for queue in list(self._consumers):
            if queue not in self._active and not self.control.is_paused(queue):
                self._subscribe(queue, self._wanted.get(queue))

    # -- channels ---------------------------------------------------------------------------------

    def _open_publisher(self) -> Any:
        """A channel with confirms for the republishes; a refused one is replaced (see :meth:`_on_refused`)."""
        channel = self._connection.channel()
        self.settler.confirmer = Confirmer(channel, check_frame_size=True, on_refused=self._on_refused)
        return channel

    def _on_refused(self, why: str) -> None:
        """Confirmer callback: the broker refused a republish and closed the channel; say so once, open another."""
        if why not in self._refusals:
            self._refusals.add(why)
            logger.error("kombu-events: %s; grant what `%spermissions` prints, then restart the worker "
                         "(service %s: the queues whose messages it refused are paused, their messages kept)",
                         why, self.declare_command[:-len("declare")], self.settings.service)
        self._channels = [channel for channel in self._channels if getattr(channel, "is_open", True)]
        self.mailbox.post(self._reopen_publisher)

    def _reopen_publisher(self) -> None:
        confirmer = self.settler.confirmer
        if self._started and confirmer is not None and confirmer.refused is not None:
            with answer_within(self._connection, doing="opening a channel for republishing"):
                self._channels.append(self._open_publisher())

    def _call(self, doing: str, fn: Callable[[], Any]) -> None:
        """A synchronous call on the worker's connection, bounded (BrokerSilent: Celery reconnects)."""
        call_within(self._connection, doing, fn)

    def call_soon_threadsafe(self, fn: Callable[[], Any]) -> None:
        """Run ``fn`` on the event loop once the callback running now has returned; from any thread."""
        self.mailbox.post(fn)

    def _check_channels(self) -> None:
        """Hub timer: a channel the broker closed (a refused consume, an ack it did not know) ends our
        consuming for good, unseen by Celery; raise a connection error so that Celery reconnects."""
        if self._started and any(not getattr(channel, "is_open", True) for channel in self._channels):
            raise ConnectionError(f"kombu-events: a channel of service {self.settings.service} was closed "
                                  f"by the broker; reconnecting to consume again")

    def shutdown(self) -> None:
        """Settle what finished after the loop stopped, wait for pending confirms, close everything."""
        self.stop()
        self.mailbox.drain()  # thread-pool completions posted once the event loop had stopped
        self.readers.commit()  # where the next worker goes on
        if self.settler.confirmer is not None:
            self.settler.confirmer.wait(timeout_s=5.0)
        self.acks.flush()
        self.readers.release()
        self._close_channels()
        self.mailbox.close(self._hub)

    def _close_channels(self) -> None:
        # Pending confirms die with their channel; their originals are redelivered.
        self.settler.confirmer = None
        try:
            for channel in self._channels:
                self._call("closing a channel", channel.close)
        except BrokerSilent as exc:  # the connection is lost: its channels go with it
            logger.info("%s", exc)
        self._channels = []

    # -- receiving ----------------------------------------------------------------------------

    def _tick(self) -> None:
        """Hub tick, before each poll: a batch to the pool if it is ready, then the acks (solo settles inline)."""
        self.handoff.tick()
        self.acks.tick()

    def _on_message(self, route: Route, message: Any) -> None:
        """kombu callback on the event loop: nothing a publisher sends may raise out of here."""
        try:
            self.acks.delivered(message)  # first: an ack with ``multiple`` must never cover it unseen
            self._receive(route, message)
        except Exception:  # a bug of ours: keep the loop (and Celery's tasks) alive; the message stays unacked
            logger.exception("kombu-events: could not take message %r from %s; left unacked",
                             message_id(message), route.handler.queue)
            self.throttle.release(message)

    def _dispatch_reader(self, route: Route, message: Any) -> None:
        """A reader's next event of its log (worker/reading.py): screened and handed over as a handler's."""
        try:
            self._receive(route, message)
        except Exception:  # a bug of ours: the event stays unacked, the reader waits until its lock is taken again
            logger.exception("kombu-events: could not take message %r of reader %s; left unacked",
                             message_id(message), route.handler.name)
            self.throttle.release(message)

    def _on_decode_error(self, route: Route, message: Any, exc: Exception) -> None:
        """kombu could not prepare the message (it no longer decodes bodies here): read it as it is."""
        logger.debug("kombu-events: kombu reported %r for a message of %s", exc, route.handler.queue)
        self._on_message(route, message)

    def _receive(self, route: Route, message: Any) -> None:
        self.throttle.take(message)
        handler = route.handler
        delivery = read_delivery(handler.queue, message.body, message.properties, message.delivery_info,
                                 received=time.monotonic())
        # received hooks; unreadable, too large, not from its publishers, redelivered, or refused by middleware
        outcome = screen(delivery, self.hooks, max_body_bytes=self.settings.max_body_bytes,
                         publishers=handler.publishers, userid=self._userid)
        if outcome is not None:
            self.settler.settle(route, delivery, message, outcome)
            return
        self.handoff.add(Received(route, delivery, message, item_of(route, delivery)))


def _ticks(hub: Any) -> set[Callable[[], Any]]:
    """The callbacks ``hub`` runs on every turn of its loop (a hub without them: a set nobody runs)."""
    ticks: set[Callable[[], Any]] = getattr(hub, "on_tick", set())
    return ticks
