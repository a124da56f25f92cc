"""The two moments of a message that do not depend on where it is settled: screening and announcing.

The worker's consumer and the test kit's stub (:mod:`kombu_events.testing.stub`) both call
them, so a delivery is screened, and its settlement seen by logs, signals and
middleware, the same way in a test as in a worker.
"""
from __future__ import annotations

__all__ = ["screen", "announce"]

from typing import Any, Callable

from .. import signals
from ..core import decision
from ..core.delivery import Delivery
from ..core.logs import log_outcome
from ..core.settlement import Step
from ..middleware.base import Hooks


def screen(delivery: Delivery, hooks: Hooks) -> decision.Outcome | None:
    """Tell the middleware a delivery was received; its Outcome if it is settled without its handler, else None.

    A header or property that cannot be read makes it undecodable; a broker
    redelivery goes back to its queue, counted (its last delivery ended without an
    ack, so it may keep killing its worker); otherwise the middleware may refuse it.
    """
    if hooks.on_received:
        hooks.received(delivery)
    if delivery.unreadable:
        return decision.Outcome(decision.UNDECODABLE, delivery.unreadable)
    if delivery.redelivered:
        return decision.Outcome(decision.REDELIVERED, "redelivered after an unacknowledged delivery")
    return hooks.before_dispatch(delivery) if hooks.on_before_dispatch else None


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
