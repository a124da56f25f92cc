"""The two moments of a message that do not depend on where it is settled: screening and announcing.

The worker's consumer and the test kit's stub (:mod:`kombu_events.testing.stub`) both call
them, so a delivery is screened, and its settlement seen by logs, signals and
middleware, the same way in a test as in a worker.
"""
from __future__ import annotations

__all__ = ["screen", "announce"]

from typing import AbstractSet, Any, Callable

from .. import signals
from ..core import decision
from ..core.delivery import Delivery
from ..core.logs import log_outcome
from ..core.settlement import Step
from ..middleware.base import Hooks


def screen(delivery: Delivery, hooks: Hooks, *, max_body_bytes: int | None = None,
           publishers: AbstractSet[str] | None = None, userid: str | None = None) -> decision.Outcome | None:
    """Tell the middleware a delivery was received; its Outcome if it is settled without its handler, else None.

    A header or property that cannot be read, or a body larger than ``max_body_bytes``
    (the service's setting; here, so that it never crosses to the pool), makes it
    undecodable; one whose ``user_id`` is not in the handler's ``publishers`` is refused
    (``userid``, the worker's own user, republished its retries: trusted too). A broker
    redelivery goes back to its queue, counted (its last delivery ended without an
    ack, so it may keep killing its worker); otherwise the middleware may refuse it.
    """
    if hooks.on_received:
        hooks.received(delivery)
    if delivery.unreadable:
        return decision.Outcome(decision.UNDECODABLE, delivery.unreadable)
    if max_body_bytes is not None and len(delivery.body) > max_body_bytes:
        return decision.Outcome(decision.UNDECODABLE, f"body of {len(delivery.body)} bytes is larger than "
                                                      f"max_body_bytes={max_body_bytes}")
    if publishers is not None:
        user_id = delivery.properties.get("user_id")
        if user_id is None or (user_id not in publishers and user_id != userid):
            return decision.Outcome(decision.REFUSED, f"published by {_user(user_id)}, not one of the handler's "
                                                      f"publishers ({', '.join(sorted(publishers))})")
    if delivery.redelivered:
        return decision.Outcome(decision.REDELIVERED, "redelivered after an unacknowledged delivery")
    return hooks.before_dispatch(delivery) if hooks.on_before_dispatch else None


def _user(user_id: Any) -> str:
    """Who published, for a reason: the RabbitMQ user, or that it did not say."""
    return "a publisher that set no user_id" if user_id is None else f"user_id {str(user_id)[:100]!r}"


def announce(sender: Callable[..., Any], hooks: Hooks, delivery: Delivery, outcome: decision.Outcome,
             step: Step) -> None:
    """One log line, the ``message_settled`` signal and the middleware's ``settled`` hook."""
    log_outcome(step.action, queue=delivery.queue, routing_key=delivery.routing_key,
                message_id=delivery.message_id, attempt=delivery.attempt, duration_ms=outcome.duration_ms,
                delay_ms=step.delay_ms, reason=step.reason)
    if signals.message_settled.receivers:
        signals.message_settled.send(
            sender=sender, queue=delivery.queue, routing_key=delivery.routing_key,
            message_id=delivery.message_id, attempt=delivery.attempt, action=step.action,
            delay_ms=step.delay_ms, reason=step.reason, handler_duration_ms=outcome.duration_ms,
            outcome=outcome)
    if hooks.on_settled:
        hooks.settled(delivery, outcome, step)
