"""The stub's readers of logs (``@events.reader``): each reads its log's records in order, one at a time.

As a worker's reader (:mod:`kombu_events.worker.reading`) hands the events of its log to the pool one by one,
the stub runs each reader over the records appended to its log that it has not read yet: each record is read
into a :class:`~kombu_events.Delivery` with its offset in ``x-stream-offset``, screened, run, planned (with
``hold``, as the worker plans a reader's) and announced as a handler's message is. A failing event is run again
in place once its backoff has passed on the virtual clock, before any later event of the reader; after
``max_retries`` it is archived and the reader goes on. A reader starts at its ``start=`` the first time
:meth:`~kombu_events.testing.StubEvents.join` (or ``advance``) runs after it was declared, as a worker that
starts then would.
"""
from __future__ import annotations

__all__ = ["StubReaders", "Place", "start_offset", "soonest"]

import copy
import time
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Callable, Sequence

from .. import registry
from ..core.delivery import Delivery, read_delivery
from ..core.handlers import Handler
from ..core.readers import GENERATION_HEADER, OFFSET_HEADER, Start
from ..core.settlement import Hold, Rerun, Step, plan
from ..errors import ConfigurationError
from ..worker.screening import announce, screen
from .records import ArchivedCopy


@dataclass
class Place:
    """Where one reader is in its log: the next offset to read, and the event it runs again in place."""

    #: The next offset to read (the reader's position).
    offset: int
    #: When the event at ``offset`` may run, in virtual ms (later than now while a retry in place waits).
    due_ms: float = 0.0
    #: The retry in place the event at ``offset`` waits for (its attempt and redeliveries), or None.
    rerun: Rerun | None = None
    #: Why the reader reads no more ('' while it reads): its event was held, as a worker holds it until it
    #: reconnects, which the stub never does.
    stopped: str = ""


def start_offset(start: Start, records: Sequence[ArchivedCopy], *, epoch: float) -> int:
    """The first offset a reader that starts now at ``start`` reads in a log holding ``records``.

    Every record is a chunk of its own: ``"last"`` is the last record (none: the next); an offset past the
    end starts at the next record, as RabbitMQ clamps it; a datetime starts at the first record appended at
    or after it, the virtual clock reading as the wall time ``epoch`` plus its seconds.
    """
    if start == "first":
        return 0
    if start == "next":
        return len(records)
    if start == "last":
        return max(len(records) - 1, 0)
    if isinstance(start, datetime):
        wanted = start.timestamp()
        return next((r.offset for r in records if epoch + r.at >= wanted), len(records))
    return min(int(start), len(records))


def soonest(*dues: float | None) -> float | None:
    """The smallest of ``dues`` that is not None; None if none is."""
    return min((due for due in dues if due is not None), default=None)


class StubReaders:
    """The readers of a stub's app, each at its place in its log (``stub`` is the
    :class:`~kombu_events.testing.StubEvents`, whose broker holds the logs and whose ``join()`` runs them)."""

    def __init__(self, stub: Any) -> None:
        self._stub = stub
        self._epoch = time.time()  # a datetime start= places the virtual clock's 0 at the stub's making
        self._places: dict[str, Place] = {}

    def _readers(self) -> list[tuple[Any, Handler]]:
        return [(events, h) for events in registry.services_of(self._stub.app) for h in events.readers]

    def _log(self, handler: Handler) -> list[Any]:
        records: list[Any] = self._stub._broker.streams.get(handler.reader.log.queue, [])
        return records  # a log's stream holds appended events only (no settlement records)

    def start(self) -> None:
        """Give each reader not started yet its place: where its ``start=`` says, in its log as it is now."""
        for _, handler in self._readers():
            if handler.queue not in self._places:
                offset = start_offset(handler.reader.start, self._log(handler), epoch=self._epoch)
                self._places[handler.queue] = Place(offset)

    def _waiting(self, by_ms: float) -> list[tuple[float, int, Any, Handler, Place]]:
        """The readers with an event to run by ``by_ms``: (when, their order, service, reader, place)."""
        found = []
        for order, (events, handler) in enumerate(self._readers()):
            place = self._places.get(handler.queue)
            if place is not None and not place.stopped and place.offset < len(self._log(handler)) \
                    and place.due_ms <= by_ms:
                found.append((place.due_ms, order, events, handler, place))
        return found

    def next_due(self, by_ms: float) -> float | None:
        """When the next event of a reader may run (ms), if it may by ``by_ms``; else None."""
        return min((due for due, *_ in self._waiting(by_ms)), default=None)

    def read(self) -> BaseException | None:
        """Run the reader whose event is due first (the first declared, at a tie) over that event, as the worker
        does; the undeclared exception the reader raised (None if there is no event due now)."""
        waiting = self._waiting(self._stub._broker.now_ms)
        if not waiting:
            return None
        _, _, events, handler, place = min(waiting, key=lambda found: found[:2])
        return self._read(events, handler, place, self._log(handler)[place.offset])

    def _read(self, events: Any, handler: Handler, place: Place, record: ArchivedCopy) -> BaseException | None:
        """Receive, screen, run, plan (holding its place) and settle one event of a reader's log."""
        stub = self._stub
        stub._failure = None
        delivery = _delivery(handler.queue, record)
        if place.rerun is not None:  # its counters, as the worker's Handoff runs it again
            delivery = delivery._replace(attempt=place.rerun.attempt, redeliveries=place.rerun.redeliveries)
        outcome = screen(delivery, events.hooks, max_body_bytes=events.settings.max_body_bytes,
                         publishers=handler.publishers, userid=stub.userid)
        if outcome is None:
            outcome = stub._run(handler, delivery)
        step = plan(delivery, outcome, max_retries=handler.max_retries, backoff=handler.backoff,
                    topology=stub._topology(events), userid=stub.userid, rand=stub._rand, hold=True)
        step = stub._carry_out(step, delivery)
        stub._record(handler, delivery, outcome, step)
        announce(handler.fn, events.hooks, delivery, outcome, step)
        self._move(place, step)
        failure: BaseException | None = stub._failure
        return failure

    def _move(self, place: Place, step: Step) -> None:
        """Where the reader goes after ``step``: the same event later, nowhere (held), or the next event."""
        if isinstance(step, Rerun):
            place.rerun, place.due_ms = step, self._stub._broker.now_ms + step.delay_ms
        elif isinstance(step, Hold):
            place.stopped = step.reason
        else:  # acked, or archived (the worker acks it once the archive took it): the position moves past it
            place.offset, place.rerun, place.due_ms = place.offset + 1, None, 0.0

    def position(self, fn: Callable[..., Any]) -> int | None:
        """The next offset the reader ``fn`` (the decorated function) reads; None before it started."""
        for _, handler in self._readers():
            if handler.fn is fn:
                place = self._places.get(handler.queue)
                return None if place is None else place.offset
        raise ConfigurationError(f"{fn!r} is not a reader of {self._stub.app!r}")


def _delivery(queue: str, record: ArchivedCopy) -> Delivery:
    """The record as a worker's reader receives it: the broker's ``x-stream-offset`` and the reader's generation
    (0: never rewound) in its headers, which a ``once=True`` reader's inbox key is made of."""
    properties = copy.deepcopy(dict(record.properties))
    headers = properties.get("application_headers")
    headers = dict(headers) if isinstance(headers, dict) else {}
    headers[OFFSET_HEADER], headers[GENERATION_HEADER] = record.offset, 0
    properties["application_headers"] = headers
    return read_delivery(queue, record.body, properties, {"routing_key": record.routing_key, "redelivered": False},
                         received=time.monotonic())
