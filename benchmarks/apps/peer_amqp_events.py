"""Peer row ``celery-amqp-events``: a handler of its ``EventsCelery`` app, in a Celery worker.

``<peer venv>/bin/python -m celery -A benchmarks.apps.peer_amqp_events worker --pool=solo -Q <queue>``
(see :mod:`benchmarks.peers`). ``events_app(KEB_SERVICE, ...)`` with the library's configuration
(``task_acks_late``, ``task_reject_on_worker_lost``, ...) and three settings: the broker, the events
exchange (``task_default_exchange``: the run's topic exchange) and ``worker_prefetch_multiplier``
``KEB_PREFETCH`` (100; a solo worker's prefetch is the multiplier, Celery's default 4). On start the app
declares its retry queues and exchanges (``AMQP_EVENTS_MAX_RETRIES``, default 10), its archive, and the
handler's queue ``<service>.<event>`` bound to the events exchange and to ``<service>:recover``. A handler
is a Celery task: messages are Celery task messages, acked by Celery after the task returns (kombu's
``Message.ack``, counted by the probe).
"""
from __future__ import annotations

import os

from amqp_events.celery import events_app

from benchmarks import probe

EVENT = "kebench.noop_event"  # benchmarks.peers.AMQP_EVENT

app = events_app(os.environ.get("KEB_SERVICE", "kebench-amqpevents"),
                 broker_url=os.environ.get("KEB_BROKER", "amqp://guest:guest@127.0.0.1:5672//"),
                 task_default_exchange=os.environ.get("KEB_EXCHANGE", "events"),
                 worker_prefetch_multiplier=int(os.environ.get("KEB_PREFETCH", "100")),
                 broker_connection_retry_on_startup=True)


@app.handler(EVENT)
def noop(i):
    probe.handled(i)


if "KEB_OUT" in os.environ:
    probe.install()
