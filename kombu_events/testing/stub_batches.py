"""The stub's batch handlers: the copies of a batch handler's queue due at one instant, one call of it.

As the worker's hand-off gathers up to ``BatchOf.max`` messages of the queue, the stub takes the
copies of the queue due now (the virtual clock does not wait ``wait_ms``: a test publishes, then
joins), runs them with the pool's own :func:`~kombu_events.worker.batch_handlers.run`, and settles
each by its own Outcome. :meth:`~kombu_events.testing.StubEvents.calls` lists one list per call.
"""
from __future__ import annotations

__all__ = ["deliver_batch"]

import copy
import time
from typing import Any

from ..core import decision
from ..core.delivery import Delivery, read_delivery
from ..core.handlers import Handler
from ..core.settlement import plan
from ..core.topology import Topology
from ..worker import batch_handlers
from ..worker.screening import announce, screen
from .stub_broker import QueuedCopy


def deliver_batch(stub: Any, first: QueuedCopy, events: Any, handler: Handler,
                  topology: Topology) -> BaseException | None:
    """Receive, screen, run (one call), plan and settle the copies of ``first``'s queue due now; the
    undeclared exception the handler raised (``stub`` is the :class:`~kombu_events.testing.StubEvents`)."""
    assert handler.batch is not None
    stub._failure = None
    broker = stub._broker
    queued = [first, *broker.take_due(handler.queue, broker.now_ms, handler.batch.max - 1)]
    deliveries = [read_delivery(q.message.queue, q.message.body, q.message.properties,
                                {"routing_key": q.delivered_with, "redelivered": False}, received=time.monotonic())
                  for q in queued]
    outcomes: list[decision.Outcome | None] = [
        screen(delivery, events.hooks, max_body_bytes=events.settings.max_body_bytes,
               publishers=handler.publishers, userid=stub.userid) for delivery in deliveries]
    to_run = [i for i, outcome in enumerate(outcomes) if outcome is None]
    if to_run:
        for i, ran in zip(to_run, _run(stub, handler, [deliveries[i] for i in to_run])):
            outcomes[i] = ran
    for delivery, outcome in zip(deliveries, outcomes):
        assert outcome is not None
        step = plan(delivery, outcome, max_retries=handler.max_retries, backoff=handler.backoff, topology=topology,
                    userid=stub.userid, rand=stub._rand)
        step = stub._carry_out(step, delivery)
        stub._record(handler, delivery, outcome, step)
        announce(handler.fn, events.hooks, delivery, outcome, step)
    failure: BaseException | None = stub._failure
    return failure


def _run(stub: Any, handler: Handler, deliveries: list[Delivery]) -> list[decision.Outcome]:
    """Run the deliveries as the pool does, in one call; the call's events become one entry of ``calls``."""
    items = [(handler.queue, d.body, d.content_type, d.content_encoding,
              (d.routing_key, d.attempt, copy.deepcopy(dict(d.headers)), copy.deepcopy(dict(d.properties))),
              decision.is_final(d.attempt, handler.max_retries)) for d in deliveries]
    calls = stub._calls.setdefault(handler.fn, [])
    before = len(calls)
    stub._running = handler
    try:
        outcomes = list(batch_handlers.run(items))
    finally:
        stub._running = None
        called = calls[before:]  # the stub saw each event start: they were one call
        del calls[before:]
        if called:
            calls.append(called)
    return outcomes
