"""Consume one service's handler queues inside a worker; hand messages to the pool; carry out plans.

Glue, on the worker's event loop: :func:`~kombu_events.core.delivery.read_delivery` reads a
message, a :class:`~kombu_events.worker.batching.Batcher` collects what one read of the loop
brings, the pool runs the handlers of a batch as one job, :func:`~kombu_events.core.settlement.plan`
decides for each message on its own, and :meth:`ServiceConsumer._execute` carries the plan out.
A republish (retry, requeue, archive) is confirmed before the original is acked, so a crash
in between duplicates, never loses. A republish the broker refuses (ACCESS_REFUSED: the user lost
*write* on a delay exchange or the archive) is no fault of the message: it is left
unacked and its queue paused until the worker restarts, with one ERROR line. The bodies held, received and
not settled, stay within the service's ``inflight_max_bytes``: an
:class:`~kombu_events.worker.inflight.InflightBudget` caps each consumer's prefetch and says when to cancel
the consumers and when to consume again.

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
import select
import threading
import time
from functools import partial
from typing import Any, Callable

from amqp import Message
from celery.exceptions import WorkerShutdown
from kombu import Consumer

from ..broker import verify
from ..broker.confirms import Confirmer
from ..broker.declare import declare
from ..broker.stream_headers import pack
from ..broker.version import QUORUM_QUEUES, require
from ..broker.waits import BrokerSilent, answer_within, call_within
from ..core import decision
from ..core.delivery import Delivery, read_delivery
from ..core.settlement import Ack, Hold, Republish, Step, plan
from ..middleware.control import Control
from ..registry import Route
from . import awaiting, runner
from .batching import BUDGET_MS, Batcher, max_messages
from .inflight import InflightBudget
from .mailbox import Mailbox
from .screening import announce, screen

logger = logging.getLogger(__name__)

#: How often the event loop looks for a channel of ours that the broker closed.
CHANNEL_CHECK_S = 5.0

#: A batch waits at most this long for a free pool process (a safety net: every job's callback frees one).
BATCH_WAIT_S = 1.0

#: A message received and not yet handed to the pool: its route, delivery, kombu message and runner arguments.
Entry = tuple[Route, Delivery, Any, runner.Item]


class ServiceConsumer:
    """The consumers of one :class:`~kombu_events.Events` service on a worker connection."""

    def __init__(self, events: Any, *, declare_command: str = "kombu-events -A APP declare") -> None:
        self.events = events
        self.settings = events.settings
        #: What creates the topology when this worker does not declare it (``declare=False``), for its error.
        self.declare_command = declare_command
        self.routes: tuple[Route, ...] = tuple(events.routes())  # resolving validates: bad config fails at start-up
        self.hooks = events.hooks
        self.topology = events.topology()
        self._queues = {q.name: q for q in self.topology.handler_queues}
        #: Handlers with a prefetch of their own (e.g. 1 for a periodic schedule's token queue).
        self._prefetch = {r.handler.queue: r.handler.prefetch for r in self.routes if r.handler.prefetch is not None}
        self.prefetch_count: int = events.prefetch_count
        #: Pause/resume and timers for middleware (the same object across reconnects).
        self.control = Control(self.settings.service, tuple(r.handler.queue for r in self.routes), self)
        self._consumers: dict[str, Consumer] = {}
        self._active: set[str] = set()
        self._started = False
        self._connection: Any = None
        self._channels: list[Any] = []
        self._confirmer: Confirmer | None = None
        self._pool: Any = None
        self._hub: Any = None
        self._userid: str | None = None
        self._loop_ident = threading.get_ident()
        self.mailbox = Mailbox(self.settings.service)
        self._channel_check: Any = None
        #: Refusals (ACCESS_REFUSED) logged so far: one ERROR line each.
        self._refusals: set[str] = set()
        #: Queues whose handlers are ``async def`` (awaited in the pool: never under gevent or eventlet).
        self.awaited = frozenset(r.handler.queue for r in self.routes if r.awaits)
        #: Messages received, not yet handed to the pool (kept across restarts: what handlers cost).
        self._batch: Batcher[Entry] = Batcher(max_messages=1, awaited=self.awaited)
        #: Whether the connection has more to read now (a batch waits for it); without a hub, never.
        self._more_to_read: Callable[[], bool] = _never
        #: Jobs handed to the pool on this connection and not returned yet, the pool's processes, when the
        #: batch began. Counted anew on each connection (``_connection_jobs``): at a connection loss Celery's
        #: prefork pool drops the jobs it had not yet written to a process, and those never call back.
        self._jobs, self._processes, self._since = 0, 1, 0.0
        self._connection_jobs = 0
        self._concurrency = 1
        #: Bodies received and not settled, against ``inflight_max_bytes`` (counted anew on each connection).
        self.budget = InflightBudget(max_bytes=self.settings.inflight_max_bytes,
                                     body_bytes=self.settings.max_body_bytes, consumers=len(self.routes))
        #: The messages counted in the budget: id(message) -> body bytes.
        self._held: dict[int, int] = {}
        #: Whether the consumers are cancelled because the budget is spent; whether that is being looked at.
        self._throttled = self._budget_posted = False
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
        self._close_channels()
        self._check_pool(pool)
        # Jobs of the last connection that are still running call back into the old count, not this one.
        self._jobs, self._connection_jobs = 0, self._connection_jobs + 1
        # What the last connection delivered is the broker's again (redelivered): nothing held on this one.
        self.budget.reset()
        self._held, self._wanted = {}, {}
        self._throttled = self._budget_posted = False
        if self.settings.declare:
            if self.settings.queue_type == "quorum":
                require(connection, *QUORUM_QUEUES)
            declare(self.topology, connection)
        else:  # on every reconnect too: someone may have deleted a queue meanwhile
            verify.check(self.topology, connection, command=self.declare_command)
        self._pool, self._hub, self._connection = pool, hub, connection
        self.mailbox.use_call_soon(call_soon if hub is None else None)
        self._userid = getattr(connection, "userid", None)
        self._loop_ident = threading.get_ident()
        channel = connection.channel()
        channel.auto_decode = False  # handlers get the body bytes as published, never a str
        channel.message_to_python = partial(_as_published, channel)
        #: Handlers the pool runs at once (processes, threads or greenlets): the budget never caps a
        #: prefetch below what keeps them busy (times async_concurrency for a queue of async def handlers).
        self._concurrency = max(1, getattr(pool, "limit", 1) or 1)
        self._qos = self.budget.prefetch(self.prefetch_count, floor=self._concurrency)
        channel.basic_qos(0, self._qos, False)
        self._channels = [channel, self._open_publisher()]
        self._consumers = {
            r.handler.queue: Consumer(channel, queues=[self._queues[r.handler.queue]], no_ack=False,
                                      auto_declare=False, on_message=partial(self._on_message, r),
                                      on_decode_error=partial(self._on_decode_error, r))
            for r in self.routes
        }
        self._active = set()
        self._batch.max_messages = 1
        self._more_to_read = _never
        if hub is not None:  # with an event loop, batches: what one read of the loop brings goes to the pool at once
            in_flight = sum(self._prefetch_of(r.handler.queue, None) for r in self.routes)
            self._processes = max(1, getattr(pool, "limit", 1) or 1)
            self._batch.max_messages = max_messages(in_flight=in_flight, processes=self._processes)
            # solo runs a batch on the event loop itself: a batch of sync handlers would hold heartbeats
            # for all of them, so only the async def ones (awaited together) go in batches there.
            self._batch.budget_ms = 0.0 if type(pool).__module__.endswith(".solo") else BUDGET_MS
            self._more_to_read = _readable(connection)
        else:
            self.consume()  # no event loop (synloop): nothing else will call consume()

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
        if self._hub is not None:
            _ticks(self._hub).discard(self._tick)
        self._flush()  # received already: handled and acked as if the step had not stopped
        if self._channel_check is not None:
            _quietly(self._channel_check.cancel)
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
        if self._throttled:
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
        return self.budget.prefetch(wanted, floor=at_once)  # any one queue may keep the whole pool busy

    # -- the budget of bytes in flight (inflight_max_bytes) -------------------------------------------

    def _take(self, message: Any) -> None:
        """Count a message received in the budget."""
        size = _body_size(message)
        self._held[id(message)] = size
        self.budget.take(size)
        self._budget_changed()

    def _release(self, message: Any) -> None:
        """A message counted in the budget is settled, or no longer ours to settle (idempotent)."""
        size = self._held.pop(id(message), None)
        if size is not None:
            self.budget.settle(size)
            self._budget_changed()

    def _budget_changed(self) -> None:
        """Pause or resume on the event loop once the callback running now has returned (never inside one:
        cancelling waits on the connection that is calling us)."""
        if self._started and self.budget.paused != self._throttled and not self._budget_posted:
            self._budget_posted = True
            self.mailbox.post(self._apply_budget)

    def _apply_budget(self) -> None:
        """Mailbox item: cancel the consumers while the budget is spent; consume again once it is not.

        A message the broker sent before its consumer was cancelled still arrives, and is handled.
        """
        self._budget_posted = False
        if not self._started or self.budget.paused == self._throttled:
            return
        self._throttled = self.budget.paused
        held = (self.settings.service, self.budget.in_flight_bytes, self.budget.in_flight,
                self.settings.inflight_max_bytes)
        if self._throttled:
            logger.info("kombu-events: service %s holds %d bytes in %d messages, over inflight_max_bytes=%d: "
                        "taking no more until some are settled", *held)
            for queue in sorted(self._active):
                self.pause_queue(queue)
        else:
            logger.info("kombu-events: service %s holds %d bytes in %d messages, within inflight_max_bytes=%d: "
                        "consuming again", *held)
            for queue in list(self._consumers):
                if queue not in self._active and not self.control.is_paused(queue):
                    self._subscribe(queue, self._wanted.get(queue))

    def _open_publisher(self) -> Any:
        """A channel with confirms for the republishes; a refused one is replaced (see :meth:`_on_refused`)."""
        channel = self._connection.channel()
        self._confirmer = Confirmer(channel, check_frame_size=True, on_refused=self._on_refused)
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
        if self._started and self._confirmer is not None and self._confirmer.refused is not None:
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
        if self._confirmer is not None:
            self._confirmer.wait(timeout_s=5.0)
        self._close_channels()
        self.mailbox.close(self._hub)

    def _close_channels(self) -> None:
        # Pending confirms die with their channel; their originals are redelivered.
        self._confirmer = None
        try:
            for channel in self._channels:
                self._call("closing a channel", channel.close)
        except BrokerSilent as exc:  # the connection is lost: its channels go with it
            logger.info("%s", exc)
        self._channels = []

    # -- receiving ----------------------------------------------------------------------------

    def _on_message(self, route: Route, message: Any) -> None:
        """kombu callback on the event loop: nothing a publisher sends may raise out of here."""
        try:
            self._receive(route, message)
        except Exception:  # a bug of ours: keep the loop (and Celery's tasks) alive; the message stays unacked
            logger.exception("kombu-events: could not take message %r from %s; left unacked",
                             _message_id(message), route.handler.queue)
            self._release(message)

    def _on_decode_error(self, route: Route, message: Any, exc: Exception) -> None:
        """kombu could not prepare the message (it no longer decodes bodies here): read it as it is."""
        logger.debug("kombu-events: kombu reported %r for a message of %s", exc, route.handler.queue)
        self._on_message(route, message)

    def _receive(self, route: Route, message: Any) -> None:
        self._take(message)
        handler = route.handler
        delivery = read_delivery(handler.queue, message.body, message.properties, message.delivery_info,
                                 received=time.monotonic())
        # received hooks; unreadable, too large, not from its publishers, redelivered, or refused by middleware
        outcome = screen(delivery, self.hooks, max_body_bytes=self.settings.max_body_bytes,
                         publishers=handler.publishers, userid=self._userid)
        if outcome is not None:
            self._settle(route, delivery, message, outcome)
            return
        meta = (delivery.routing_key, delivery.attempt, delivery.headers, delivery.properties)
        item = (handler.queue, delivery.body, delivery.content_type, delivery.content_encoding, meta,
                decision.is_final(delivery.attempt, handler.max_retries))
        if self._batch.add(handler.queue, (route, delivery, message, item)) or self._ready():
            self._flush()
        elif len(self._batch) == 1:
            self._since = time.monotonic()
            if self._hub is not None:  # an idle event loop sleeps for up to 10 s between ticks
                self._hub.call_later(BATCH_WAIT_S, self._tick)

    def _ready(self) -> bool:
        """Whether to hand the batch over now: a pool process is free and the loop has read what was there.

        While every process is busy, messages wait for the first to be free (or for the batch to be
        full): the job it then gets holds them all, so ``async def`` handlers arriving one by one are
        still awaited together.
        """
        return self._jobs < self._processes and not self._more_to_read()

    def _tick(self) -> None:
        """Hub tick, before each poll (and a timer when a batch begins to wait): hand over a batch that is
        ready (or has waited ``BATCH_WAIT_S``)."""
        try:
            if len(self._batch) and (self._ready() or time.monotonic() - self._since >= BATCH_WAIT_S):
                self._flush()
        except Exception:  # never into the hub: its loop would end
            logger.exception("kombu-events: handing a batch of service %s to the pool failed", self.settings.service)

    def _returned(self, connection_jobs: int) -> None:
        """A job came back (on the loop thread): its process is free; a batch waiting for one goes now."""
        if connection_jobs == self._connection_jobs:  # else counted on a connection gone since
            self._jobs = max(0, self._jobs - 1)
        if len(self._batch) and self._ready():
            self._flush()

    def _flush(self) -> None:
        """Hand the batch to the pool: one message as before (``runner.run``), several as one job (``run_batch``)."""
        entries = self._batch.take()
        if len(entries) == 1:
            self._hand_over(*entries[0])
        elif entries:
            done = partial(self._post_batch, self._connection_jobs, entries)
            self._jobs += 1  # before: solo calls back from inside apply_async
            try:
                self._pool.apply_async(runner.run_batch, ([entry[3] for entry in entries],
                                                          self.settings.async_concurrency),
                                       callback=done, error_callback=done)
            except Exception as exc:  # e.g. one message's headers too deep to pickle: each on its own, then
                self._jobs -= 1
                logger.debug("kombu-events: a batch of %d could not be handed to the pool (%r); one by one",
                             len(entries), exc)
                for entry in entries:
                    self._hand_over(*entry)

    def _hand_over(self, route: Route, delivery: Delivery, message: Any, item: runner.Item,
                   refused: Callable[[str], Step] | None = None) -> None:
        """One message to the pool; one it refuses is archived (it cannot be pickled), or ``refused(why)``."""
        done = partial(self._post, self._connection_jobs, route, delivery, message)
        self._jobs += 1
        try:
            self._pool.apply_async(runner.run, item, callback=done, error_callback=done)
        except Exception as exc:  # e.g. headers nested too deep to pickle for a prefork child
            self._jobs -= 1
            what = decision.describe(exc)
            outcome = decision.Outcome(decision.UNDECODABLE, f"cannot be handed to the pool: {what}", what)
            if refused is None:
                self._settle(route, delivery, message, outcome)
            else:  # a pool shutting down refuses jobs: nothing wrong with the message
                self._release(message)
                self._settled(route, delivery, outcome, refused(what))

    def _post(self, connection_jobs: int, *item: Any) -> None:
        """Pool callback: settle on the loop thread (thread pools call back from their threads)."""
        if self.mailbox.pipe is None or threading.get_ident() == self._loop_ident:
            self._ran(connection_jobs, *item)  # the common case, without building a callable per message
        else:
            try:
                self.mailbox.post(partial(self._ran, connection_jobs, *item))
            except Exception:  # e.g. the wake pipe closed at shutdown: the message stays unacked
                logger.exception("kombu-events: could not hand a result back to the event loop; left unacked")

    def _post_batch(self, connection_jobs: int, entries: list[Entry], result: Any) -> None:
        """Pool callback of a batch: its Outcomes, or why its pool process was lost (settled as for :meth:`_post`)."""
        if self.mailbox.pipe is None or threading.get_ident() == self._loop_ident:
            self._ran_batch(connection_jobs, entries, result)
        else:
            try:
                self.mailbox.post(partial(self._ran_batch, connection_jobs, entries, result))
            except Exception:  # e.g. the wake pipe closed at shutdown: the messages stay unacked
                logger.exception("kombu-events: could not hand %d results back to the event loop; left unacked",
                                 len(entries))

    def _ran_batch(self, connection_jobs: int, entries: list[Entry], result: Any) -> None:
        """Settle each message of a batch on its own; a batch whose pool process was lost goes back to the
        pool one message at a time, no attempt spent: a message that kills its process is then lost alone."""
        if not (isinstance(result, list) and len(result) == len(entries)):
            self._again_one_by_one(entries, result)
        else:
            self._batch.observe_batch([(entry[0].handler.queue, getattr(outcome, "duration_ms", 0.0))
                                       for entry, outcome in zip(entries, result)],
                                      getattr(result, "elapsed_ms", -1.0))
            for (route, delivery, message, _), outcome in zip(entries, result):
                self._settle(route, delivery, message, outcome)
        self._returned(connection_jobs)

    def _again_one_by_one(self, entries: list[Entry], result: Any) -> None:
        """Hand each message of a lost batch to the pool again, on its own (its handler may have run: at least once)."""
        logger.warning("kombu-events: a pool process died holding a batch of %d messages of service %s (%s); "
                       "each goes to the pool again on its own, no attempt spent", len(entries),
                       self.settings.service, decision.lost(result, traceback_limit=0).exception)
        for entry in entries:
            self._hand_over(*entry, refused=_left_unacked)

    def _ran(self, connection_jobs: int, route: Route, delivery: Delivery, message: Any, result: Any) -> None:
        """Note what the handler cost (the batches' budget), then settle."""
        if isinstance(result, decision.Outcome) and result.duration_ms > 0:
            self._batch.observe(route.handler.queue, result.duration_ms)
        self._settle(route, delivery, message, result)
        self._returned(connection_jobs)

    # -- carrying out the plan -----------------------------------------------------------------

    def _settle(self, route: Route, delivery: Delivery, message: Any, result: Any) -> None:
        try:
            outcome = result if isinstance(result, decision.Outcome) else \
                decision.lost(result, traceback_limit=self.settings.traceback_limit)
            step = plan(delivery, outcome, max_retries=route.handler.max_retries, backoff=route.handler.backoff,
                        topology=self.topology, userid=self._userid)
            self._execute(route, delivery, message, outcome, step)
        except Exception:  # never let one message break the event loop; it stays unacked
            logger.exception("kombu-events: could not settle message %r from %s; left unacked",
                             delivery.message_id, delivery.queue)
            self._release(message)

    def _execute(self, route: Route, delivery: Delivery, message: Any, outcome: decision.Outcome,
                 step: Step) -> None:
        """Carry out ``step``: ack; or republish and ack once confirmed (else its fallback); or hold."""
        if isinstance(step, Republish):
            confirmer = self._confirmer
            if confirmer is None:
                self._release(message)
                return  # channels are gone: the original is redelivered
            # Both called by the Confirmer (which logs what they raise), inside py-amqp's frame dispatch.
            on_ok = partial(self._ack, route, delivery, message, outcome, step)

            def on_fail(why: str) -> None:
                if confirmer.refused is not None:  # a missing permission, not this message: no fallback
                    self.control.pause(route.handler.queue, f"{step.action} refused: {confirmer.refused}")
                    held = Hold(f"{step.action} publish refused by the broker (a permission is missing); "
                                "left unacked, queue paused")
                    self._release(message)
                    self._settled(route, delivery, outcome, held)
                else:
                    self._execute(route, delivery, message, outcome, step.if_refused(why))

            try:
                properties = pack(step.properties) if step.action == "archive" else step.properties
                confirmer.publish(Message(delivery.body, **properties), step.exchange, step.routing_key,
                                  on_ok, on_fail)
            except Exception as exc:  # not sent (connection lost, frame too large, unencodable header)
                on_fail(f"publish raised {type(exc).__name__}: {exc}")
        elif isinstance(step, Ack):
            self._ack(route, delivery, message, outcome, step)
        else:
            self._release(message)
            self._settled(route, delivery, outcome, step)

    def _ack(self, route: Route, delivery: Delivery, message: Any, outcome: decision.Outcome, step: Step) -> None:
        acked = _quietly(message.ack)
        self._release(message)  # acked, or its channel is gone and the broker redelivers it
        if acked:
            self._settled(route, delivery, outcome, step)

    def _settled(self, route: Route, delivery: Delivery, outcome: decision.Outcome, step: Step) -> None:
        """One log line, the ``message_settled`` signal and the middleware's ``settled`` hook."""
        announce(route.handler.fn, self.hooks, delivery, outcome, step)


def _never() -> bool:
    return False


def _left_unacked(why: str) -> Hold:
    return Hold(f"could not be handed to the pool again ({why}); left unacked, redelivered on reconnect")


def _ticks(hub: Any) -> set[Callable[[], Any]]:
    """The callbacks ``hub`` runs on every turn of its loop (a hub without them: a set nobody runs)."""
    ticks: set[Callable[[], Any]] = getattr(hub, "on_tick", set())
    return ticks


def _readable(connection: Any) -> Callable[[], bool]:
    """Whether ``connection`` has bytes to read now (py-amqp's buffer, TLS's, or the socket's); else never."""
    try:
        transport = connection.connection.transport
        sock = transport.sock
        poller = select.poll()
        poller.register(sock.fileno(), select.POLLIN)
    except Exception as exc:  # another transport, or not connected: no batches, every message at once
        logger.debug("kombu-events: cannot watch the connection for batching: %r", exc)
        return _never
    pending = getattr(sock, "pending", None)  # TLS: decrypted bytes the socket no longer shows

    def more() -> bool:
        return bool(transport._read_buffer) or bool(pending and pending()) or bool(poller.poll(0))

    return more


def _as_published(channel: Any, raw: Any) -> Any:
    """kombu's message for ``raw``, without kombu's own decompression: the body stays as published.

    kombu inflates a body whose ``compression`` header it knows, and raises from inside
    its consumer for one it does not; an event keeps its bytes (a retry republishes
    exactly what arrived), and the runner decompresses for the handler.
    """
    headers = raw.properties.get("application_headers")
    if not isinstance(headers, dict) or headers.get("compression") is None:
        return channel.Message(raw, channel=channel)
    items = list(headers.items())
    del headers["compression"]  # hidden from kombu while it builds its message, then put back in place
    try:
        return channel.Message(raw, channel=channel)
    finally:
        headers.clear()
        headers.update(items)


def _body_size(message: Any) -> int:
    """The size of a message's body as received (0 for one that has none to measure)."""
    try:
        return len(message.body)
    except Exception:
        return 0


def _message_id(message: Any) -> Any:
    """The message id of a message that may be broken in any way, for a log line."""
    try:
        return message.properties.get("message_id")
    except Exception:
        return None


def _quietly(fn: Any, *args: Any) -> bool:
    """Call ``fn``; log and swallow errors of a channel that closed under us."""
    try:
        fn(*args)
        return True
    except Exception as exc:
        logger.debug("kombu-events: %s failed: %s", getattr(fn, "__name__", fn), exc)
        return False
