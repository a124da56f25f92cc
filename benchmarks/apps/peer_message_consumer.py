"""Peer row ``celery-message-consumer``: its ``AMQPRetryConsumerStep`` in a Celery worker.

``<peer venv>/bin/python -m celery -A benchmarks.apps.peer_message_consumer worker --pool=solo -Q <empty>``
(see :mod:`benchmarks.peers`). One ``@message_handler`` on the runner's queue ``KEB_QUEUE``, bound to the
run's topic exchange ``KEB_EXCHANGE`` with the queue's name as routing key, as the library's settings let
one name it: ``EXCHANGES`` and ``PREFETCH_COUNT`` (``KEB_PREFETCH``, 100; the library's default is 1),
given through its ``EVENT_CONSUMER_APP_CONFIG`` object. The step consumes on its own channel of the
worker's connection, in the worker's main process (the pool never sees the messages), and acks each
message with kombu's ``Message.ack`` after the handler returns (counted by the probe). It also declares
``<queue>.retry`` and ``<queue>.archived``.

Python 3.10 removed the ``collections`` aliases of ``Mapping``, ``MutableMapping`` and ``Sequence``; the
library's settings (flexisettings, configloader) need attrdict, whose every release imports them. They
are restored here, before the library is imported: the only change to what the library runs.
"""
from __future__ import annotations

import collections
import collections.abc
import os
from typing import ClassVar

from celery import Celery

from benchmarks import probe

for _name in ("Mapping", "MutableMapping", "Sequence"):
    if not hasattr(collections, _name):
        setattr(collections, _name, getattr(collections.abc, _name))


class Config:
    """The library's settings (namespace ``EVENT_CONSUMER``), read when ``event_consumer`` is imported."""

    EVENT_CONSUMER_PREFETCH_COUNT = int(os.environ.get("KEB_PREFETCH", "100"))
    EVENT_CONSUMER_EXCHANGES: ClassVar[dict] = {"kebench": {"name": os.environ.get("KEB_EXCHANGE", "kebench.events"),
                                                          "type": "topic"}}


os.environ.setdefault("EVENT_CONSUMER_APP_CONFIG", f"{__name__}.Config")

from event_consumer import message_handler  # noqa: E402 -- after the aliases and the config above
from event_consumer.handlers import AMQPRetryConsumerStep  # noqa: E402

QUEUE = os.environ.get("KEB_QUEUE", "kebench.msgconsumer")


@message_handler(QUEUE, queue=QUEUE, exchange="kebench")
def noop(body):
    probe.handled(body["i"])


app = Celery("kebench-msgconsumer", broker=os.environ.get("KEB_BROKER", "amqp://guest:guest@127.0.0.1:5672//"))
app.conf.broker_connection_retry_on_startup = True
app.conf.task_default_queue = os.environ.get("KEB_TASKQ", "kebench.tasks")
app.steps["consumer"].add(AMQPRetryConsumerStep)

if "KEB_OUT" in os.environ:
    probe.install()
