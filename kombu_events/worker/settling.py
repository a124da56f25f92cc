"""Carry out what :func:`~kombu_events.core.settlement.plan` decides for a message the handler ran (or that
never reached it): ack; republish (retry, requeue, archive) and ack once the broker confirms; or hold.

Acks go through :class:`~kombu_events.worker.acks.Acks`, which sends those of one read of the event loop
together. A republish is confirmed before the original is acked, so a crash in between duplicates, never loses. A
republish the broker refuses for a missing permission (ACCESS_REFUSED: the user lost *write* on a delay
exchange or the archive) is no fault of the message: it stays unacked and its queue is paused until the
worker restarts. Called on the event loop; nothing raised here reaches it.
"""
from __future__ import annotations

__all__ = ["Settler"]

import logging
from functools import partial
from typing import Any, Callable

from amqp import Message

from ..broker.confirms import Confirmer
from ..broker.stream_headers import pack
from ..core import decision
from ..core.delivery import Delivery
from ..core.settlement import Ack, Hold, Republish, Rerun, Step, plan
from ..core.topology import Topology
from ..middleware.control import Control
from ..registry import Route
from .acks import Acks
from .screening import announce

logger = logging.getLogger(__name__)


class Settler:
    """Plans and carries out the settling of each message of one service, on its publisher channel."""

    def __init__(self, *, topology: Topology, hooks: Any, control: Control, traceback_limit: int,
                 release: Callable[[Any], None], acks: Acks | None = None) -> None:
        self.topology = topology
        self.hooks = hooks
        self.control = control
        self.traceback_limit = traceback_limit
        #: The message no longer counts in the bytes held (settled, or no longer ours to settle).
        self.release = release
        #: Sends the acks of the consumers' channel together (None: each message's own ``ack()``).
        self.acks = acks
        #: Runs a held message's handler again after a delay (a retry in the worker, ``retry_in_place_ms`` or an
        #: ordered handler holding its partition: the Handoff's).
        self.rerun: Callable[[Route, Delivery, Any, Rerun], None] | None = None
        #: The publisher channel's confirms (None: no channel, the originals are redelivered).
        self.confirmer: Confirmer | None = None
        #: The worker's AMQP user, for the plan (a republish keeps the publisher's ``user_id`` only if it is ours).
        self.userid: str | None = None
        #: Told of each message acked (a reader's position moves past it: worker/reading.py).
        self.acked: Callable[[Route, Any], None] | None = None

    def settle(self, route: Route, delivery: Delivery, message: Any, result: Any) -> None:
        """Plan for ``result`` (an Outcome, or why the pool lost the job) and carry the plan out."""
        try:
            outcome = result if isinstance(result, decision.Outcome) else \
                decision.lost(result, traceback_limit=self.traceback_limit)
            ordering = route.handler.ordering
            step = plan(delivery, outcome, max_retries=route.handler.max_retries, backoff=route.handler.backoff,
                        topology=self.topology, userid=self.userid,
                        hold=(ordering is not None and ordering.hold_failures) or route.handler.reader is not None,
                        in_place_ms=0 if self.rerun is None else self.topology.settings.retry_in_place_ms)
            self.execute(route, delivery, message, outcome, step)
        except Exception:  # never let one message break the event loop; it stays unacked
            logger.exception("kombu-events: could not settle message %r from %s; left unacked",
                             delivery.message_id, delivery.queue)
            self.release(message)

    def execute(self, route: Route, delivery: Delivery, message: Any, outcome: decision.Outcome,
                step: Step) -> None:
        """Carry out ``step``: ack; or republish and ack once confirmed (else its fallback); or hold."""
        if isinstance(step, Republish):
            self._republish(route, delivery, message, outcome, step)
        elif isinstance(step, Ack):
            self._ack(route, delivery, message, outcome, step)
        elif isinstance(step, Rerun) and self.rerun is not None:  # unacked until an attempt settles it
            self.announce(route, delivery, outcome, step)
            self.rerun(route, delivery, message, step)
        else:
            self.hold(route, delivery, message, outcome, step)

    def hold(self, route: Route, delivery: Delivery, message: Any, outcome: decision.Outcome, step: Step) -> None:
        """Leave ``message`` unacked (the broker redelivers it on reconnect), and say so."""
        self.release(message)
        self.announce(route, delivery, outcome, step)

    def announce(self, route: Route, delivery: Delivery, outcome: decision.Outcome, step: Step) -> None:
        """One log line, the ``message_settled`` signal and the middleware's ``settled`` hook."""
        announce(route.handler.fn, self.hooks, delivery, outcome, step)

    def _republish(self, route: Route, delivery: Delivery, message: Any, outcome: decision.Outcome,
                   step: Republish) -> None:
        confirmer = self.confirmer
        if confirmer is None:
            self.release(message)
            return  # channels are gone: the original is redelivered
        # Both called by the Confirmer (which logs what they raise), inside py-amqp's frame dispatch.
        on_ok = partial(self._ack, route, delivery, message, outcome, step)

        def on_fail(why: str) -> None:
            if confirmer.refused is not None:  # a missing permission, not this message: no fallback
                self.control.pause(route.handler.queue, f"{step.action} refused: {confirmer.refused}")
                self.hold(route, delivery, message, outcome,
                          Hold(f"{step.action} publish refused by the broker (a permission is missing); "
                               "left unacked, queue paused"))
            else:
                self.execute(route, delivery, message, outcome, step.if_refused(why))

        try:
            properties = pack(step.properties) if step.action == "archive" else step.properties
            confirmer.publish(Message(delivery.body, **properties), step.exchange, step.routing_key, on_ok, on_fail)
        except Exception as exc:  # not sent (connection lost, frame too large, unencodable header)
            on_fail(f"publish raised {type(exc).__name__}: {exc}")

    def _ack(self, route: Route, delivery: Delivery, message: Any, outcome: decision.Outcome, step: Step) -> None:
        acked = quietly(message.ack) if self.acks is None else quietly(self.acks.ack, message)
        self.release(message)  # acked, or its channel is gone and the broker redelivers it
        if acked:
            if self.acked is not None:
                quietly(self.acked, route, message)
            self.announce(route, delivery, outcome, step)


def quietly(fn: Any, *args: Any) -> bool:
    """Call ``fn``; log and swallow errors of a channel that closed under us."""
    try:
        fn(*args)
        return True
    except Exception as exc:
        logger.debug("kombu-events: %s failed: %s", getattr(fn, "__name__", fn), exc)
        return False
