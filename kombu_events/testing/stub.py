"""``StubEvents``: an app's handlers run in-process by the worker's own code, over a virtual clock.

No broker, no worker, no second failure policy: every message, published or
republished, goes through the in-memory broker of :mod:`kombu_events.testing.stub_broker`,
which routes it through the app's own topology to where RabbitMQ would put it. A copy
that comes due in a handler queue is read into a :class:`~kombu_events.Delivery`,
screened and announced as the worker's consumer does (:mod:`kombu_events.worker.screening`),
run by the runner the pool runs, and settled by the planner's step, carried out in
memory: a retry's copy waits out the ladder on the virtual clock
(:meth:`StubEvents.advance`), an archived copy is appended to the service's archive
stream under its archive key, where :meth:`StubEvents.archive` lists what is still
archived and :meth:`~StubEvents.replay` and :meth:`~StubEvents.purge` settle copies by
appending records, as ``kombu-events archive`` does. A republish no queue takes
is returned, and its fallback taken, as in the worker; a copy the ladder would drop on
the way stops the stub. Nothing sleeps.
"""
from __future__ import annotations

__all__ = ["StubEvents", "LostCopy", "LOOP_LIMIT"]

import copy
import itertools
import logging
import random
import time
from decimal import Decimal
from types import TracebackType
from typing import Any, Callable, Mapping

from .. import registry, signals
from ..core import archive_records, decision, wire
from ..core.codec import JSON
from ..core.delivery import Delivery, read_delivery
from ..core.event import Event
from ..core.handlers import Handler
from ..core.settlement import Republish, Step, plan
from ..core.topology import Topology
from ..errors import ConfigurationError, KombuEventsError
from ..events import Events
from ..publishing.publisher import Publisher
from ..worker import runner
from ..worker.screening import announce, screen
from .broker_model import Routed
from .records import ArchivedCopy, Pending, SentMessage, Settled, fails_fast
from .stub_batches import deliver_batch
from .stub_broker import LostCopy, QueuedCopy, StubBroker
from .stub_publishing import StubPublisher, broker_user, default_exchange, published_message
from .stub_readers import StubReaders, soonest

logger = logging.getLogger(__name__)

#: Deliveries at one instant of the virtual clock after which join() gives up: something loops.
LOOP_LIMIT = 10_000


class StubEvents:
    """The broker and worker of one Celery app, in memory: publish, then ``join()`` or ``advance()``.

    ``target`` is an :class:`~kombu_events.Events` (its exchange is the default one
    ``publish`` uses) or the Celery app; every ``Events`` service of the app gets the
    events it is bound to. Every republished copy (retry, requeue, archive) goes where
    the topology routes the step's exchange and routing key; one that no queue takes is
    returned, and the step's fallback taken, as in a worker. ``refuse(step)`` may
    return why the broker refuses a copy besides. ``rand`` feeds backoff jitter. As a
    context manager, the app's own ``events.publish``/``publish_many`` publish into the
    stub until it exits.
    """

    def __init__(self, target: Any, *, refuse: Callable[[Republish], str | None] | None = None,
                 rand: Callable[[], float] = random.random) -> None:
        self._events = target if isinstance(target, Events) else None
        self.app = target.app if isinstance(target, Events) else target
        if not registry.resolve(self.app):  # validates every service, as a worker does at start-up
            raise ConfigurationError(f"no Events service is registered on {self.app!r}")
        self._refuse = refuse
        self._rand = rand
        self._topologies: dict[int, tuple[tuple[Handler, ...], Topology]] = {}
        self._calls: dict[Callable[..., Any], list[Any]] = {}
        self._running: Handler | None = None  # the handler runner.run is running now
        self._failure: BaseException | None = None  # the undeclared exception it raised
        self._saved: list[tuple[Events, Publisher | None]] = []
        self._broker = StubBroker(self.app, lambda: tuple(self._topology(e) for e in registry.services_of(self.app)))
        self._readers = StubReaders(self)  # the readers of the app's logs, each at its place
        #: Every settled delivery, in order (``acked``, ``retried``, ... are views of it).
        self.settled: list[Settled] = []
        #: The RabbitMQ user the worker would connect as (the broker URL's): the ``user_id`` of its republished copies.
        self.userid: str | None = broker_user(self.app.conf.broker_url)

    # -- records --------------------------------------------------------------------------------

    @property
    def published(self) -> list[SentMessage]:
        """Every message published, in order."""
        return self._broker.published

    @property
    def lost(self) -> list[LostCopy]:
        """Every copy the topology would drop on its way (join() and advance() raise for each)."""
        return self._broker.lost

    @property
    def now(self) -> float:
        """The virtual clock, in seconds since the stub was made."""
        return self._broker.now

    def _of(self, *actions: str) -> list[Settled]:
        return [s for s in self.settled if s.action in actions]

    @property
    def acked(self) -> list[Settled]:
        """Deliveries whose handler returned."""
        return self._of("ack")

    @property
    def retried(self) -> list[Settled]:
        """Failed attempts sent back through the delay ladder (``delay_ms``, ``reason``, the copy's headers)."""
        return self._of("retry")

    @property
    def requeued(self) -> list[Settled]:
        """Deliveries sent back without spending an attempt (a middleware's DEFERRED outcome)."""
        return self._of("requeue")

    @property
    def archived(self) -> list[Settled]:
        """Deliveries archived: ``reason`` and the archived copy's ``headers`` (``kombu-events-reason``, ...)."""
        return self._of("archive")

    @property
    def held(self) -> list[Settled]:
        """Deliveries left unacknowledged because every republish was refused (see ``refuse``)."""
        return self._of("held")

    @property
    def pending(self) -> list[Pending]:
        """Messages waiting in handler queues, the next due first."""
        return self._broker.pending

    # -- the archive --------------------------------------------------------------------------------

    def archive(self, events: Events | None = None) -> list[ArchivedCopy]:
        """The copies still in the archive of ``events`` (default: the stub's, or the app's one service), oldest
        first: neither replayed nor purged."""
        return self._broker.archive(self._topology(self._service(events)).archive_exchange).pending()

    def replay(self, match: Callable[[ArchivedCopy], bool] = lambda copy: True, *, events: Events | None = None,
               to_queue: str | None = None, by: str | None = None) -> list[ArchivedCopy]:
        """Send the archived copies that ``match`` back to their handler queues (``to_queue``: all to that one) with
        a fresh attempt count and the archive key in ``kombu-events-replay-of``, and settle them as replayed; the
        copies replayed. A copy whose queue is not the service's, or that the broker returns, stays archived.
        Handlers run on ``join()``."""
        service = self._service(events)
        topology = self._topology(service)
        handler_queues = {q.name for q in topology.handler_queues}
        replayed: list[ArchivedCopy] = []
        for archived in [c for c in self.archive(service) if match(c)]:
            queue = to_queue or archived.queue
            if queue not in handler_queues:
                continue
            address = topology.address(queue, 0)
            routed, why = self._broker.republish(address.exchange, address.routing_key)
            if routed is None or why is not None:
                continue
            headers = wire.replay_headers(archived.headers, archive_key=archived.key)
            properties = wire.republish_properties(archived.properties, headers, userid=self.userid)
            self._broker.land(routed, archived.routing_key, archived.body, properties)
            replayed.append(archived)
        self._broker.settle(topology.archive_exchange, archive_records.REPLAYED, [c.key for c in replayed],
                            by=by or self.userid, detail={c.key: to_queue or c.queue for c in replayed})
        return replayed

    def purge(self, match: Callable[[ArchivedCopy], bool] = lambda copy: True, *, events: Events | None = None,
              by: str | None = None, note: str = "") -> list[ArchivedCopy]:
        """Settle the archived copies that ``match`` as purged (no longer listed; the stream keeps them); them."""
        service = self._service(events)
        purged = [c for c in self.archive(service) if match(c)]
        self._broker.settle(self._topology(service).archive_exchange, archive_records.PURGED,
                            [c.key for c in purged], by=by or self.userid, note=note)
        return purged

    def log(self, name: str, *, events: Events | None = None) -> list[Any]:
        """The payloads appended to the log ``name`` of ``events`` (default: the stub's, or the app's one service),
        in publish order, decoded as JSON (DecodeError for a body that is not)."""
        service = self._service(events)
        log = next((log for log in service.logs if log.name == name), None)
        if log is None:
            raise ConfigurationError(f"service {service.service!r} has no log {name!r}; its logs: "
                                     f"{', '.join(log.name for log in service.logs) or 'none'}")
        return [r.payload for r in self._broker.streams.get(log.queue, ()) if isinstance(r, ArchivedCopy)]

    def _service(self, events: Events | None) -> Events:
        if events is not None:
            return events
        if self._events is not None:
            return self._events
        services = registry.services_of(self.app)
        if len(services) != 1:
            raise ConfigurationError(f"the app has {len(services)} services: pass events=")
        found: Events = services[0]
        return found

    def calls(self, handler: Callable[..., Any]) -> list[Any]:
        """What ``handler`` (the decorated function, a reader's too) was called with, in order: payloads, or Events
        with bind=True (a batch handler's: one list per call).

        Raises ConfigurationError for a function that is no handler of the app: an
        assertion that it was never called would pass for the wrong reason.
        """
        if not any(h.fn is handler for events in registry.services_of(self.app)
                   for h in events.handlers + events.readers):
            raise ConfigurationError(f"{handler!r} is not a handler or reader of {self.app!r}")
        return list(self._calls.get(handler, ()))

    def position(self, reader: Callable[..., Any]) -> int | None:
        """The next offset ``reader`` (the decorated function) reads in its log; None before it started (it starts
        at its ``start=`` on the first join() or advance() after it was declared)."""
        return self._readers.position(reader)

    # -- publishing -----------------------------------------------------------------------------

    def publish(self, routing_key: str, payload: Any = None, *, headers: Mapping[str, Any] | None = None,
                content_type: str | None = JSON, content_encoding: str | None = "utf-8",
                message_id: str | None = None, correlation_id: str | None = None,
                properties: Mapping[str, Any] | None = None, exchange: str | None = None,
                mandatory: bool = True) -> Any:
        """Publish as any AMQP publisher would; return the ``message_id``. Handlers run on ``join()``.

        ``payload`` is sent as JSON, ``bytes`` as they are; ``content_type`` or
        ``content_encoding`` None leaves that property out; ``properties`` adds or
        replaces any other. ``mandatory``: raise UnroutableError when no queue is bound.
        """
        body, sent = published_message(payload, headers, content_type, content_encoding, message_id,
                                       correlation_id, properties)
        exchange = exchange or default_exchange(self._events, self.app)
        error = self._broker.route(exchange, routing_key, body, sent, mandatory)
        if error is not None:
            raise error
        return sent.get("message_id")

    # -- the clock --------------------------------------------------------------------------------

    def join(self, *, fail_fast: bool = True) -> None:
        """Handle every message due now, and what they publish or retry with no delay, until none is due; so do
        the readers of the app's logs with the events appended to them (testing/stub_readers.py).

        Messages due later stay pending until :meth:`advance`. ``fail_fast``: once its
        message is settled, re-raise the first exception of a handler that
        :func:`fails_fast` says nobody declared (the messages after it stay pending).
        """
        registry.resolve(self.app)  # the runner finds this app's handler by queue name
        self._broker.check_lost()
        self._readers.start()
        with _Listening(self):
            for count in itertools.count(1):
                queued = self._broker.next_due(self._broker.now_ms) is not None
                if not queued and self._readers.next_due(self._broker.now_ms) is None:
                    return
                if count > LOOP_LIMIT:
                    raise KombuEventsError(f"join() handled {LOOP_LIMIT} messages at t={self.now:g} s and more are "
                                           "due: does a handler or middleware send them back with no delay?")
                failure = self._deliver(self._broker.take()) if queued else self._readers.read()
                self._broker.check_lost()
                if fail_fast and failure is not None:
                    raise failure

    def advance(self, seconds: float, *, fail_fast: bool = True) -> None:
        """Move the clock ``seconds`` forward, handling each message when it comes due (retries of retries too).

        If ``fail_fast`` re-raises, the clock stays where the failed message came due.
        """
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not seconds >= 0:
            raise ValueError(f"advance() takes seconds >= 0, got {seconds!r}")
        clock = self._broker
        target_ms = clock.now_ms + float(Decimal(repr(float(seconds))) * 1000)
        self.join(fail_fast=fail_fast)
        while (due_ms := soonest(clock.next_due(target_ms), self._readers.next_due(target_ms))) is not None:
            clock.now_ms = max(clock.now_ms, due_ms)
            self.join(fail_fast=fail_fast)
        clock.now_ms = target_ms

    # -- one delivery, as the worker's consumer and pool handle it -------------------------------

    def _route_of(self, queue: str) -> tuple[Events, Handler, Topology]:
        for events in registry.services_of(self.app):
            for handler in events.handlers:
                if handler.queue == queue:
                    return events, handler, self._topology(events)
        raise ConfigurationError(f"no handler of {self.app!r} consumes queue {queue!r}")

    def _topology(self, events: Events) -> Topology:
        handlers = events.handlers
        cached = self._topologies.get(id(events))
        if cached is None or cached[0] is not handlers:
            cached = self._topologies[id(events)] = (handlers, events.topology())
        return cached[1]

    def _deliver(self, queued: QueuedCopy) -> BaseException | None:
        """Receive, screen, run, plan and settle one message; the undeclared exception its handler raised."""
        message, self._failure = queued.message, None
        events, handler, topology = self._route_of(message.queue)
        if handler.batch is not None:  # with the other copies of its queue due now: one call
            return deliver_batch(self, queued, events, handler, topology)
        delivery = read_delivery(message.queue, message.body, message.properties,
                                 {"routing_key": queued.delivered_with, "redelivered": False},
                                 received=time.monotonic())
        outcome = screen(delivery, events.hooks, max_body_bytes=events.settings.max_body_bytes,
                         publishers=handler.publishers, userid=self.userid)
        if outcome is None:
            outcome = self._run(handler, delivery)
        step = plan(delivery, outcome, max_retries=handler.max_retries, backoff=handler.backoff, topology=topology,
                    userid=self.userid, rand=self._rand)
        step = self._carry_out(step, delivery)
        self._record(handler, delivery, outcome, step)
        announce(handler.fn, events.hooks, delivery, outcome, step)
        return self._failure

    def _run(self, handler: Handler, delivery: Delivery) -> decision.Outcome:
        """Run the handler as the worker's pool does."""
        # Copies, as a prefork pool gets them through its pipe: a handler that changes
        # event.headers does not change the message that is retried or archived.
        meta = (delivery.routing_key, delivery.attempt, copy.deepcopy(dict(delivery.headers)),
                copy.deepcopy(dict(delivery.properties)))
        self._running = handler
        try:
            return runner.run(handler.queue, delivery.body, delivery.content_type, delivery.content_encoding, meta,
                              decision.is_final(delivery.attempt, handler.max_retries))
        finally:
            self._running = None

    def _carry_out(self, step: Step, delivery: Delivery) -> Step:
        """What the broker does with ``step``: a refused or returned copy takes its fallback, as in the worker;
        a taken copy lands wherever the topology routes its exchange and routing key (a retry after the ladder)."""
        routed: Routed | None = None
        while isinstance(step, Republish):
            why = self._refuse(step) if self._refuse is not None else None
            if why is None:
                routed, why = self._broker.republish(step.exchange, step.routing_key)
            if why is None:
                break
            step = step.if_refused(why)
        if isinstance(step, Republish) and routed is not None:
            self._broker.land(routed, delivery.routing_key, delivery.body, step.properties)
        return step

    def _record(self, handler: Handler, delivery: Delivery, outcome: decision.Outcome, step: Step) -> None:
        if isinstance(step, Republish):
            properties: Mapping[str, Any] = step.properties
            headers: Mapping[str, Any] = step.properties["application_headers"]
        else:
            properties, headers = delivery.properties, delivery.headers
        self.settled.append(Settled(step.action, delivery.queue, delivery.routing_key, delivery.attempt, handler.fn,
                                    step.reason, step.delay_ms, headers, delivery.body, properties, outcome,
                                    self.now))

    # -- seeing what runs in the pool ---------------------------------------------------------------

    def _started(self, sender: Callable[..., Any], event: Event | None = None, **kwargs: Any) -> None:
        handler = self._running
        if handler is not None and sender is handler.fn and event is not None:
            self._calls.setdefault(sender, []).append(event if handler.bind else event.payload)

    def _failed(self, sender: Callable[..., Any], exception: BaseException | None = None, **kwargs: Any) -> None:
        handler = self._running
        if handler is not None and sender is handler.fn and exception is not None and self._failure is None \
                and fails_fast(exception, handler):
            self._failure = exception

    # -- standing in for the broker of the app's own publishes -------------------------------------

    def __enter__(self) -> StubEvents:
        """Make the app's services publish into this stub (``events.publish``, ``publish_many``, ``@event``)."""
        for events in registry.services_of(self.app):
            self._saved.append((events, events.publishing._publisher))
            events.publishing.publisher = StubPublisher(self._broker)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        """Give the app's services their own publishers back."""
        while self._saved:
            events, publisher = self._saved.pop()
            events.publishing.publisher = publisher


class _Listening:
    """Connects the stub to the pool signals while it runs handlers (and only then)."""

    def __init__(self, stub: StubEvents) -> None:
        self.stub = stub
        self.uid = f"kombu_events.testing.stub.{id(stub)}"

    def __enter__(self) -> None:
        signals.handler_started.connect(weak=False, dispatch_uid=self.uid + ".started")(self.stub._started)
        signals.handler_failed.connect(weak=False, dispatch_uid=self.uid + ".failed")(self.stub._failed)

    def __exit__(self, *exc_info: Any) -> None:
        signals.handler_started.disconnect(dispatch_uid=self.uid + ".started")
        signals.handler_failed.disconnect(dispatch_uid=self.uid + ".failed")
