"""A kombu Consumer whose callback is on its channel before its ``basic.consume`` goes out.

py-amqp registers a consumer's callback once the broker's ``consume-ok`` arrives, and rejects (requeue)
a delivery for a consumer tag it does not know yet. RabbitMQ may send a queue's first delivery before
that ``consume-ok``: seen on 3.10 with the waiting events of single-active-consumer queues (an ordered
handler's partitions), one rejected per partition at every worker start. The rejected event came back
redelivered, which a worker settles by requeueing it at the tail of its queue: behind the later events of
its key. Registering the callback when kombu picks the tag (before it sends ``basic.consume``) lets py-amqp
hand such a delivery to the consumer like any other.
"""
from __future__ import annotations

__all__ = ["EagerConsumer"]

from typing import Any

from kombu import Consumer


class EagerConsumer(Consumer):
    """:class:`kombu.Consumer` that takes its deliveries from the moment it asks for them."""

    def _add_tag(self, queue: Any, consumer_tag: Any = None) -> str:
        tag: str = super()._add_tag(queue, consumer_tag)
        callbacks = getattr(self.channel, "callbacks", None)  # py-amqp's consumer tag -> callback
        if isinstance(callbacks, dict):
            callbacks[tag] = self._receive_callback  # basic_consume sets the same once consume-ok arrives
        return tag
