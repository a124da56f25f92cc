"""Celery's own queues beside quorum event queues: on a cluster they must outlive a node too.

A classic queue lives on one node. When that node dies, a worker that reconnects to
another node cannot declare the queue again (``404 NOT_FOUND - home node ... is
down``), Celery's consumer blueprint stops, and the events step, which is a part of
it, stops with it. So a worker whose services use quorum queues refuses to start
while it would consume a durable classic task queue, and lets Celery's consumer
restart after a channel error (``broker_channel_error_retry``) instead of giving up.
"""
from __future__ import annotations

__all__ = ["check_task_queues", "classic_task_queues"]

import logging
from typing import Any, Iterable

from .errors import ConfigurationError

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


def check_task_queues(app: Any, services: Iterable[Any]) -> None:
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
