"""Celery's own queues beside quorum event queues: on a cluster they must outlive a node too.

A classic queue lives on one node. When that node dies, a worker that reconnects to
another node cannot declare the queue again (``404 NOT_FOUND - home node ... is
down``), Celery's consumer blueprint stops, and the events step, which is a part of
it, stops with it. So a worker whose services use quorum queues refuses to start
while it would consume a durable classic task queue, and lets Celery's consumer
restart after a channel error (``broker_channel_error_retry``) instead of giving up.

Quorum task queues bring Celery's native delayed delivery (the ``DelayedDelivery``
consumer step, Celery >= 5.5), which sets itself up on every URL of ``broker_url`` in
turn and retries a dead one for about 17 s before the worker consumes anything, on
every reconnect. The URLs of a cluster share its exchanges and queues, so the events
step has it set up through the node the worker is connected to (see
:func:`follow_connection`): a worker that fails over sets it up again on the new node.
"""
from __future__ import annotations

__all__ = ["check_task_queues", "classic_task_queues", "follow_connection"]

import logging
from typing import Any, Iterable

from ..errors import ConfigurationError
from ..registry import EventsService

try:  # Celery >= 5.5
    from celery.worker.consumer import delayed_delivery
except ImportError:  # pragma: no cover - older Celery has no native delayed delivery
    delayed_delivery = None

logger = logging.getLogger(__name__)


def classic_task_queues(app: Any) -> list[str]:
    """Names of the durable classic queues this worker consumes tasks from (sorted).

    Auto-deleted and exclusive queues (remote control, events, ``worker_direct``) are
    declared afresh on whichever node the worker reconnects to, so they do not count.
    """
    queues = app.amqp.queues.consume_from or {}
    return sorted(
        name for name, queue in queues.items()
        if queue.durable and not queue.auto_delete and not queue.exclusive
        and (queue.queue_arguments or {}).get("x-queue-type", "classic") == "classic"
    )


def check_task_queues(app: Any, services: Iterable[EventsService]) -> None:
    """Raise ConfigurationError if a quorum service shares its worker with a classic task queue.

    Otherwise, with any quorum service, turn ``broker_channel_error_retry`` on (logged):
    a declare refused while the cluster fails over restarts the consumer, events step
    included, instead of leaving it down.
    """
    quorum = [e.settings.service for e in services if e.settings.queue_type == "quorum"]
    if not quorum:
        return
    classic = classic_task_queues(app)
    if classic:
        raise ConfigurationError(
            f"service(s) {', '.join(map(repr, quorum))} use quorum queues, but this worker would also consume "
            f"the classic task queue(s) {', '.join(map(repr, classic))}: on a cluster, when the node holding a "
            "classic queue dies, Celery's consumer cannot declare it again and stops, and event consumption with "
            "it. Make Celery's queues quorum too: task_default_queue_type = 'quorum' (and "
            "queue_arguments={'x-queue-type': 'quorum'} on every Queue of task_queues; an existing classic queue "
            "of the same name must be deleted once empty), or leave them out of this worker with -Q")
    if not app.conf.broker_channel_error_retry:
        app.conf.broker_channel_error_retry = True
        logger.info("kombu-events: broker_channel_error_retry turned on for quorum service(s) %s: a channel "
                    "error while the cluster fails over restarts the consumer", ", ".join(quorum))


if delayed_delivery is not None:
    class ConnectedNodeDelayedDelivery(delayed_delivery.DelayedDelivery):
        """Celery's native delayed delivery, set up through the URL the consumer is connected to."""

        name = delayed_delivery.DelayedDelivery.name  # the blueprint knows the step by it

        def start(self, c: Any) -> None:
            """Declare and bind through ``c.connection``'s node only; errors logged, as Celery does."""
            self._validate_configuration(c.app)
            url = c.connection.as_uri(include_password=True)
            try:
                delayed_delivery.retry_over_time(
                    self._setup_delayed_delivery, args=(c, url), catch=delayed_delivery.RETRIED_EXCEPTIONS,
                    errback=self._on_retry, interval_start=delayed_delivery.RETRY_INTERVAL,
                    max_retries=delayed_delivery.MAX_RETRIES)
            except Exception as exc:  # Celery logs the same and goes on: the consumer restarts if the node is gone
                logger.warning("kombu-events: native delayed delivery not set up on %s: %s",
                               c.connection.as_uri(), exc)


def follow_connection(consumer: Any) -> bool:
    """Make the worker's ``DelayedDelivery`` step set up through the connected node only.

    Done when ``broker_url`` lists several URLs (a cluster) and Celery's step is in
    ``consumer``'s blueprint; returns whether it was.
    """
    urls = consumer.app.conf.broker_url or ""
    if delayed_delivery is None or len(urls if isinstance(urls, (list, tuple)) else urls.split(";")) < 2:
        return False
    steps = getattr(getattr(consumer, "blueprint", None), "steps", None) or {}
    step = steps.get(delayed_delivery.DelayedDelivery.name)
    if not isinstance(step, delayed_delivery.DelayedDelivery) or not _celery_has_what_it_uses():
        return False
    step.__class__ = ConnectedNodeDelayedDelivery
    logger.info("kombu-events: Celery's native delayed delivery is set up through the connected node only, "
                "not on each of broker_url's URLs in turn: a dead node would hold the worker back ~17 s")
    return True


def _celery_has_what_it_uses() -> bool:
    """Whether this Celery's DelayedDelivery still has the parts the subclass calls (else Celery's is kept)."""
    parts = ("_setup_delayed_delivery", "_validate_configuration", "_on_retry")
    names = ("retry_over_time", "RETRIED_EXCEPTIONS", "RETRY_INTERVAL", "MAX_RETRIES")
    return (all(hasattr(delayed_delivery.DelayedDelivery, part) for part in parts)
            and all(hasattr(delayed_delivery, name) for name in names))
