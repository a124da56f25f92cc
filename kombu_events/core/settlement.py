"""The pure settle planner: from a delivery and how its attempt ended, the steps that settle it.

:func:`plan` is the one entry point. A step is :class:`Ack`, :class:`Republish` (publish a
copy, confirmed, then ack the original) or :class:`Hold` (leave it unacked). A
Republish names what to do if the broker refuses the copy: a refused retry or
requeue is archived; a refused archive is tried once more with only the library's
headers (the publisher's may be what the broker refused); if that is refused too,
the message is held, unacked and visible, rather than dropped.
"""
from __future__ import annotations

__all__ = ["Ack", "Republish", "Hold", "Rerun", "Step", "plan", "archive_step", "ACK"]

import random
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable, ClassVar, Union

from . import wire
from .backoff import Backoff
from .decision import REDELIVERED, Outcome, decide
from .delivery import Delivery
from .topology import Topology


@dataclass(frozen=True)
class Ack:
    """Acknowledge the message: it is settled."""

    action: ClassVar[str] = "ack"
    delay_ms: ClassVar[float] = 0
    reason: str = ""


@dataclass(frozen=True)
class Hold:
    """Leave the message unacknowledged (visible in the broker; redelivered on reconnect)."""

    action: ClassVar[str] = "held"
    delay_ms: ClassVar[float] = 0
    reason: str = ""


@dataclass(frozen=True)
class Republish:
    """Publish a copy (mandatory, confirmed) and ack the original once the broker confirms it.

    ``action`` is ``retry``, ``requeue`` or ``archive``; ``if_refused(why)`` is the next
    step when the broker returns or nacks the copy, or it cannot be sent.
    """

    action: str
    exchange: str
    routing_key: str | bytes
    properties: dict[str, Any]
    delay_ms: float = 0
    reason: str = ""
    if_refused: Callable[[str], Step] = field(default=lambda why: Hold(why), repr=False, compare=False)


@dataclass(frozen=True)
class Rerun:
    """Keep the message (unacked) and run its handler again after ``delay_ms``, as ``attempt``: a retry within
    the ``retry_in_place_ms`` setting (docs/failures.md), or the retry (or requeue) of an ordered handler whose
    failing event holds its partition (``hold_failures=True``, docs/ordering.md)."""

    action: ClassVar[str] = "rerun"
    delay_ms: float = 0
    reason: str = ""
    #: The counters of the run to come: a retry spends an attempt; a requeue (a broker redelivery, a deferral)
    #: spends none and counts the redelivery, as its copy through the ladder would.
    attempt: int = 1
    redeliveries: int = 0


Step = Union[Ack, Republish, Hold, Rerun]

ACK = Ack()


def plan(
    delivery: Delivery,
    outcome: Outcome,
    *,
    max_retries: int,
    backoff: Backoff,
    topology: Topology,
    userid: str | None = None,
    rand: Callable[[], float] = random.random,
    hold: bool = False,
    in_place_ms: float = 0,
) -> Step:
    """The first step that settles ``delivery`` after its attempt ended with ``outcome``.

    ``hold``: a retry (or a requeue) runs the handler again in place, after the same delay (:class:`Rerun`),
    instead of going through the ladder while later messages of the queue pass it. ``in_place_ms``: so does a
    retry whose delay is at most that (the ``retry_in_place_ms`` setting; 0: none).
    """
    settings = topology.settings
    redeliveries = delivery.redeliveries + (outcome.kind == REDELIVERED)
    decision = decide(outcome, attempt=delivery.attempt, max_retries=max_retries, backoff=backoff,
                      max_delay_ms=settings.max_delay_ms, lost_delay_ms=settings.delay_unit_ms,
                      redeliveries=redeliveries, rand=rand)
    if decision.action == "ack":
        return ACK
    if decision.action == "archive":
        return archive_step(delivery, outcome, decision.reason, topology=topology, userid=userid)
    in_place = decision.action == "retry" and in_place_ms > 0 and decision.delay_ms <= in_place_ms
    if hold or in_place:
        attempt = delivery.attempt + 1 if decision.action == "retry" else delivery.attempt
        return Rerun(decision.delay_ms, decision.reason, attempt, redeliveries)
    if decision.action == "retry":
        headers = wire.retry_headers(delivery.headers, attempt=delivery.attempt, routing_key=delivery.routing_key,
                                     error=outcome.exception or decision.reason)
    else:
        headers = wire.requeue_headers(delivery.headers, attempt=delivery.attempt, redeliveries=redeliveries,
                                       routing_key=delivery.routing_key)
    address = topology.address(delivery.queue, decision.delay_ms)
    fallback = partial(_refused, delivery, outcome, decision.action, decision.reason, topology, userid)
    return Republish(decision.action, address.exchange, address.routing_key,
                     wire.republish_properties(delivery.properties, headers, userid=userid),
                     address.delay_ms, decision.reason, fallback)


def archive_step(delivery: Delivery, outcome: Outcome, reason: str, *, topology: Topology,
                 userid: str | None = None) -> Republish:
    """Publish to the service's archive with the failure headers (then ack)."""
    headers = wire.archive_headers(delivery.headers, attempt=delivery.attempt, queue=delivery.queue,
                                   routing_key=delivery.routing_key, reason=reason, exception=outcome.exception,
                                   traceback=outcome.traceback)
    return Republish("archive", topology.archive_exchange, wire.as_sent(delivery.routing_key),
                     wire.republish_properties(delivery.properties, headers, userid=userid), 0, reason,
                     partial(_stripped, delivery, outcome, reason, topology, userid))


def _refused(delivery: Delivery, outcome: Outcome, action: str, reason: str, topology: Topology,
             userid: str | None, why: str) -> Step:
    return archive_step(delivery, outcome, f"{action} publish failed ({why}); {reason}", topology=topology,
                        userid=userid)


def _stripped(delivery: Delivery, outcome: Outcome, reason: str, topology: Topology, userid: str | None,
              why: str) -> Step:
    """The archive copy with the library's headers only: the publisher's may be what was refused."""
    headers = wire.archive_headers(None, attempt=delivery.attempt, queue=delivery.queue,
                                   routing_key=wire.as_sent(delivery.routing_key), reason=reason,
                                   exception=outcome.exception, traceback="")
    headers[wire.DROPPED_HEADERS] = f"archiving with the publisher's headers failed ({why}); they were dropped"
    return Republish("archive", topology.archive_exchange, wire.as_sent(delivery.routing_key),
                     wire.republish_properties(delivery.properties, headers, userid=userid), 0, reason,
                     partial(_held, reason))


def _held(reason: str, why: str) -> Hold:
    return Hold(f"archive publish failed ({why}); message left unacked: {reason}")
