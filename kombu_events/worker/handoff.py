"""The hand-off to the pool: what the consumers receive waits in a batch, goes to the pool (one message as
one job, several as one job), and comes back, on the event loop, to be settled.

A :class:`~kombu_events.worker.batching.Batcher` decides what goes together: what one read of the loop
brings, while a pool process is free. The jobs in the pool are counted on each connection: at a
connection loss Celery's prefork pool drops the jobs it had not yet written to a process, and those never
call back, so a job of a connection gone since no longer counts.

A handler with a ``concurrency`` of its own has at most that many of its messages in the pool at once
(whatever the pool: processes, threads, or coroutines awaited together); the next waits here, unacked,
until one of them comes back. The count is the worker's: this process hands every job to the pool.
"""
from __future__ import annotations

__all__ = ["Received", "Handoff", "readable", "item_of"]

import heapq
import itertools
import logging
import select
import threading
import time
from collections import deque
from contextlib import nullcontext
from functools import partial
from typing import Any, Callable, Mapping, NamedTuple, Protocol

from ..core import decision
from ..core.delivery import Delivery
from ..core.settlement import Hold, Rerun, Step
from ..registry import Route
from . import batch_handlers, runner
from .batching import BUDGET_MS, Batcher, max_messages
from .gathering import Gatherer
from .mailbox import Mailbox

logger = logging.getLogger(__name__)

#: A batch waits at most this long for a free pool process (a safety net: every job's callback frees one).
BATCH_WAIT_S = 1.0


class Received(NamedTuple):
    """A message received and not yet handed to the pool."""

    route: Route
    delivery: Delivery
    #: kombu's message: what is acked.
    message: Any
    #: The runner's arguments (:func:`runner.run`).
    item: runner.Item


class Settles(Protocol):
    """What the hand-off needs of whoever settles: :class:`~kombu_events.worker.settling.Settler`."""

    #: The channel's acks (:class:`~kombu_events.worker.acks.Acks`; None: each message's own ``ack()``).
    acks: Any

    def settle(self, route: Route, delivery: Delivery, message: Any, result: Any) -> None: ...

    def hold(self, route: Route, delivery: Delivery, message: Any, outcome: decision.Outcome, step: Step) -> None: ...


class Handoff:
    """Messages received, to the pool and back: batches, the jobs in the pool, their results to ``settler``."""

    def __init__(self, service: str, *, awaited: frozenset[str], async_concurrency: int, mailbox: Mailbox,
                 settler: Settles, limits: Mapping[str, int] | None = None,
                 batches: Mapping[str, tuple[int, float]] | None = None) -> None:
        self.service = service
        #: Queues whose handler has a ``concurrency``: at most this many of their messages in the pool at once.
        self.limits = dict(limits or {})
        #: Messages of each such queue in the pool now (on this connection), and those waiting for room.
        self.running: dict[str, int] = {}
        self.waiting: dict[str, deque[Received]] = {}
        self._draining: set[str] = set()
        self.async_concurrency = async_concurrency
        self.mailbox = mailbox
        self.settler = settler
        #: Messages received, not yet handed to the pool (kept across connections: what handlers cost).
        self.batch: Batcher[Received] = Batcher(max_messages=1, awaited=awaited)
        #: Whether the connection has more to read now (a batch waits for it); without a hub, never.
        self.more_to_read: Callable[[], bool] = never
        self.pool: Any = None
        self.hub: Any = None
        #: Jobs in the pool on this connection and not returned yet; the pool's processes; when the batch began.
        self.jobs, self.processes, self.since = 0, 1, 0.0
        #: Which connection this is: a job's callback counts only on the connection that handed it over.
        self.connection_jobs = 0
        self.loop_ident = threading.get_ident()
        #: Batch handlers' messages, held until their batch is full or has waited (queue: (max, wait_ms)).
        self.gatherer: Gatherer[Received] = Gatherer(batches or {}, self.hand_batch)
        #: Messages to run again (:meth:`rerun`), soonest first: (when due, order, their connection, message).
        self.reruns: list[tuple[float, int, int, Received]] = []
        self._rerun_order = itertools.count()
        #: The hub timer that wakes the loop for the soonest rerun, and when it is set for.
        self._wake: Any = None
        self._wake_at = float("inf")
        self.clock: Callable[[], float] = time.monotonic

    def attach(self, connection: Any, pool: Any, hub: Any, *, in_flight: int) -> None:
        """A new connection (Celery reconnected): count jobs anew; batch only with an event loop (``hub``)."""
        self.jobs, self.connection_jobs = 0, self.connection_jobs + 1
        # What waited was delivered on the last connection: the broker delivers it again.
        self.running, self.waiting = {}, {}
        self.reruns.clear()
        self._unwake()
        self.pool, self.hub = pool, hub
        self.loop_ident = threading.get_ident()
        self.gatherer.attach(hub)
        self.batch.max_messages = 1
        self.more_to_read = never
        if hub is not None:  # what one read of the loop brings goes to the pool at once
            self.processes = max(1, getattr(pool, "limit", 1) or 1)
            self.batch.max_messages = max_messages(in_flight=in_flight, processes=self.processes)
            # solo runs a batch on the event loop itself: a batch of sync handlers would hold heartbeats
            # for all of them, so only the async def ones (awaited together) go in batches there.
            self.batch.budget_ms = 0.0 if type(pool).__module__.endswith(".solo") else BUDGET_MS
            self.more_to_read = readable(connection)

    def add(self, received: Received) -> None:
        """A message received: to the pool now if the batch is full or ready, else it waits with the batch."""
        if received.route.handler.queue in self.gatherer:  # a batch handler's: held for its own batch
            self.gatherer.add(received.route.handler.queue, received)
            return
        if self.batch.add(received.route.handler.queue, received) or self.ready():
            self.flush()
        elif len(self.batch) == 1:
            self.since = time.monotonic()
            if self.hub is not None:  # an idle event loop sleeps for up to 10 s between ticks
                self.hub.call_later(BATCH_WAIT_S, self.tick)

    def ready(self) -> bool:
        """Whether to hand the batch over now: a pool process is free and the loop has read what was there.

        While every process is busy, messages wait for the first to be free (or for the batch to be
        full): the job it then gets holds them all, so ``async def`` handlers arriving one by one are
        still awaited together.
        """
        return self.jobs < self.processes and not self.more_to_read()

    def tick(self) -> None:
        """Hub tick, before each poll (and a timer when a batch begins to wait): hand over a batch that is
        ready (or has waited ``BATCH_WAIT_S``)."""
        try:
            if len(self.batch) and (self.ready() or time.monotonic() - self.since >= BATCH_WAIT_S):
                self.flush()
        except Exception:  # never into the hub: its loop would end
            logger.exception("kombu-events: handing a batch of service %s to the pool failed", self.service)
        if self.reruns and self.reruns[0][0] <= self.clock():
            self.run_due()

    def flush(self) -> None:
        """Hand the batch to the pool: one message on its own (``runner.run``), several as one job (``run_batch``)."""
        batch = self.batch.take()
        if self.limits:
            batch = self._admitted(batch)
        if len(batch) == 1:
            self.hand_over(batch[0])
        elif batch:
            self._hand_job(runner.run_batch, batch)

    def hand_over(self, received: Received, refused: Callable[[str], Step] | None = None) -> None:
        """One message to the pool; one it refuses is archived (it cannot be pickled), or held as ``refused(why)``."""
        route, delivery, message, item = received
        done = partial(self._post, self.connection_jobs, route, delivery, message)
        self.jobs += 1
        try:
            run = batch_handlers.run_one if route.handler.queue in self.gatherer else runner.run
            self.pool.apply_async(run, item, callback=done, error_callback=done)
        except Exception as exc:  # e.g. headers nested too deep to pickle for a prefork child
            self.jobs -= 1
            self._ended(route.handler.queue)
            what = decision.describe(exc)
            outcome = decision.Outcome(decision.UNDECODABLE, f"cannot be handed to the pool: {what}", what)
            if refused is None:
                self.settler.settle(route, delivery, message, outcome)
            else:  # a pool shutting down refuses jobs: nothing wrong with the message
                self.settler.hold(route, delivery, message, outcome, refused(what))

    def hand_batch(self, batch: list[Received]) -> None:
        """A batch handler's messages to the pool as one job: one call of the handler with them all."""
        self._hand_job(batch_handlers.run, batch)

    def _hand_job(self, run: Callable[..., Any], batch: list[Received]) -> None:
        """Several messages to the pool as one job of ``run``; one the pool refuses goes on its own, then."""
        done = partial(self._post_batch, self.connection_jobs, batch)
        self.jobs += 1  # before: solo calls back from inside apply_async
        try:
            self.pool.apply_async(run, ([received.item for received in batch], self.async_concurrency),
                                  callback=done, error_callback=done)
        except Exception as exc:  # e.g. one message's headers too deep to pickle: each on its own, then
            self.jobs -= 1
            logger.debug("kombu-events: a batch of %d could not be handed to the pool (%r); one by one",
                         len(batch), exc)
            for received in batch:
                self.hand_over(received)

    def rerun(self, route: Route, delivery: Delivery, message: Any, step: Rerun) -> None:
        """Hand ``message`` to the pool again after the step's delay, with its counters: a retry in the worker
        (``retry_in_place_ms``, a partition holding its failing event: docs/ordering.md). It stays unacked
        meanwhile; after a reconnect it is the broker's again (redelivered), and is not run here.

        With an event loop, one hub timer wakes the loop for the soonest, and every one due then goes (the
        hub fires at most 10 timers a turn, and waits a second after that: one timer per message stalled
        many retries waiting at once)."""
        again = delivery._replace(attempt=step.attempt, redeliveries=step.redeliveries)
        received = Received(route, again, message, item_of(route, again))
        if self.hub is None:  # no event loop (gevent, eventlet): a timer thread posts it to the loop's mailbox
            connection = self.connection_jobs
            timer = threading.Timer(step.delay_ms / 1000.0, self.mailbox.post,
                                    (partial(self._run_again, connection, received),))
            timer.daemon = True
            timer.start()
            return
        due = self.clock() + step.delay_ms / 1000.0
        heapq.heappush(self.reruns, (due, next(self._rerun_order), self.connection_jobs, received))
        self._arm()

    def run_due(self) -> None:
        """Hand over every rerun that is due, soonest first."""
        reruns, now = self.reruns, self.clock()
        while reruns and reruns[0][0] <= now:
            _, _, connection, received = heapq.heappop(reruns)
            self._run_again(connection, received)

    def _woken(self) -> None:
        """The hub timer of the soonest rerun: run what is due, then set the timer for the next."""
        self._wake, self._wake_at = None, float("inf")
        try:
            self.run_due()
            self._arm()
        except Exception:  # never into the hub: its loop would end; the messages stay unacked
            logger.exception("kombu-events: running messages of service %s again failed; left unacked",
                             self.service)

    def _arm(self) -> None:
        """Set the hub timer for the soonest rerun, unless one is set for it already."""
        if self.reruns and self.hub is not None and self.reruns[0][0] < self._wake_at:
            self._unwake()
            due = self.reruns[0][0]
            self._wake_at = due
            self._wake = self.hub.call_later(max(0.0, due - self.clock()), self._woken)

    def _unwake(self) -> None:
        wake, self._wake, self._wake_at = self._wake, None, float("inf")
        cancel = getattr(wake, "cancel", None)
        if cancel is not None:
            cancel()

    def _run_again(self, connection: int, received: Received) -> None:
        """As a message received now: batched with others for the pool, within its handler's ``concurrency``."""
        try:
            if connection == self.connection_jobs:
                self.add(received)
        except Exception:  # never into the hub: its loop would end; the message stays unacked
            logger.exception("kombu-events: running message %r of %s again failed; left unacked",
                             received.delivery.message_id, received.delivery.queue)

    # -- handlers' concurrency -----------------------------------------------------------------

    def _admitted(self, batch: list[Received]) -> list[Received]:
        """The messages of ``batch`` their handler's ``concurrency`` lets into the pool now; the others wait,
        in order, behind those of their queue that wait already."""
        admitted = []
        for received in batch:
            queue = received.route.handler.queue
            limit = self.limits.get(queue)
            if limit is None:
                admitted.append(received)
            elif self.running.get(queue, 0) < limit and not self.waiting.get(queue):
                self.running[queue] = self.running.get(queue, 0) + 1
                admitted.append(received)
            else:
                self.waiting.setdefault(queue, deque()).append(received)
        return admitted

    def _ended(self, queue: str) -> None:
        """A message of ``queue`` left the pool: the next of its queue waiting goes, while there is room.

        Iterative: under the solo pool a hand-over runs the handler and comes back here before it returns.
        """
        limit = self.limits.get(queue)
        if limit is None:
            return
        self.running[queue] = max(0, self.running.get(queue, 0) - 1)
        waiting = self.waiting.get(queue)
        if not waiting or queue in self._draining:
            return  # nothing waits, or the loop below (further up this call stack) goes on with it
        self._draining.add(queue)
        try:
            while waiting and self.running[queue] < limit:
                self.running[queue] += 1
                self.hand_over(waiting.popleft())
        finally:
            self._draining.discard(queue)

    # -- back from the pool ---------------------------------------------------------------------

    def _on_loop(self) -> bool:
        return self.mailbox.pipe is None or threading.get_ident() == self.loop_ident

    def _post(self, connection_jobs: int, *job: Any) -> None:
        """Pool callback: settle on the loop thread (thread pools call back from their threads)."""
        if self._on_loop():
            self._ran(connection_jobs, *job)  # the common case, without building a callable per message
        else:
            try:
                self.mailbox.post(partial(self._ran, connection_jobs, *job))
            except Exception:  # e.g. the wake pipe closed at shutdown: the message stays unacked
                logger.exception("kombu-events: could not hand a result back to the event loop; left unacked")

    def _post_batch(self, connection_jobs: int, batch: list[Received], result: Any) -> None:
        """Pool callback of a batch: its Outcomes, or why its pool process was lost (settled as for :meth:`_post`)."""
        if self._on_loop():
            self._ran_batch(connection_jobs, batch, result)
        else:
            try:
                self.mailbox.post(partial(self._ran_batch, connection_jobs, batch, result))
            except Exception:  # e.g. the wake pipe closed at shutdown: the messages stay unacked
                logger.exception("kombu-events: could not hand %d results back to the event loop; left unacked",
                                 len(batch))

    def _ran(self, connection_jobs: int, route: Route, delivery: Delivery, message: Any, result: Any) -> None:
        """Note what the handler cost (the batches' budget), then settle."""
        if isinstance(result, decision.Outcome) and result.duration_ms > 0:
            self.batch.observe(route.handler.queue, result.duration_ms)
        self.settler.settle(route, delivery, message, result)
        if self.limits and connection_jobs == self.connection_jobs:
            self._ended(route.handler.queue)
        self._returned(connection_jobs)

    def _ran_batch(self, connection_jobs: int, batch: list[Received], result: Any) -> None:
        """Settle each message of a batch on its own; a batch whose pool process was lost goes back to the
        pool one message at a time, no attempt spent: a message that kills its process is then lost alone."""
        if not (isinstance(result, list) and len(result) == len(batch)):
            self._again_one_by_one(batch, result)
        else:
            self.batch.observe_batch([(received.route.handler.queue, getattr(outcome, "duration_ms", 0.0))
                                      for received, outcome in zip(batch, result)],
                                     getattr(result, "elapsed_ms", -1.0))
            acks = self.settler.acks
            with acks.together() if acks is not None else nullcontext():
                for (route, delivery, message, _), outcome in zip(batch, result):
                    self.settler.settle(route, delivery, message, outcome)
            if self.limits and connection_jobs == self.connection_jobs:
                for received in batch:
                    self._ended(received.route.handler.queue)
        self._returned(connection_jobs)

    def _again_one_by_one(self, batch: list[Received], result: Any) -> None:
        """Hand each message of a lost batch to the pool again, on its own (its handler may have run: at least once)."""
        logger.warning("kombu-events: a pool process died holding a batch of %d messages of service %s (%s); "
                       "each goes to the pool again on its own, no attempt spent", len(batch), self.service,
                       decision.lost(result, traceback_limit=0).exception)
        for received in batch:
            self.hand_over(received, refused=_left_unacked)

    def _returned(self, connection_jobs: int) -> None:
        """A job came back (on the loop thread): its process is free; a batch waiting for one goes now."""
        if connection_jobs == self.connection_jobs:  # else counted on a connection gone since
            self.jobs = max(0, self.jobs - 1)
        if len(self.batch) and self.ready():
            self.flush()


def item_of(route: Route, delivery: Delivery) -> runner.Item:
    """The runner's arguments for ``delivery`` (what crosses to a prefork child: plain values)."""
    handler = route.handler
    meta = (delivery.routing_key, delivery.attempt, delivery.headers, delivery.properties)
    return (handler.queue, delivery.body, delivery.content_type, delivery.content_encoding, meta,
            decision.is_final(delivery.attempt, handler.max_retries))


def never() -> bool:
    return False


def _left_unacked(why: str) -> Hold:
    return Hold(f"could not be handed to the pool again ({why}); left unacked, redelivered on reconnect")


def readable(connection: Any) -> Callable[[], bool]:
    """Whether ``connection`` has bytes to read now (py-amqp's buffer, TLS's, or the socket's); else never."""
    try:
        transport = connection.connection.transport
        sock = transport.sock
        poller = select.poll()
        poller.register(sock.fileno(), select.POLLIN)
    except Exception as exc:  # another transport, or not connected: no batches, every message at once
        logger.debug("kombu-events: cannot watch the connection for batching: %r", exc)
        return never
    pending = getattr(sock, "pending", None)  # TLS: decrypted bytes the socket no longer shows

    def more() -> bool:
        return bool(transport._read_buffer) or bool(pending and pending()) or bool(poller.poll(0))

    return more
