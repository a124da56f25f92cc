"""A consumer's callback is on its channel before its basic.consume is sent (a delivery may come first)."""
from __future__ import annotations

from typing import Any

from kombu import Queue

from kombu_events.broker.eager_consumer import EagerConsumer


class Channel:
    """The part of a py-amqp channel kombu's consume uses: what was registered when basic_consume went out."""

    def __init__(self) -> None:
        self.callbacks: dict[str, Any] = {}
        self.registered_at_consume: dict[str, Any] = {}

    def basic_consume(self, queue: str = "", consumer_tag: str = "", callback: Any = None, **kwargs: Any) -> str:
        self.registered_at_consume = dict(self.callbacks)
        self.callbacks[consumer_tag] = callback
        return consumer_tag


def test_the_callback_is_registered_before_basic_consume_goes_out():
    channel = Channel()
    consumer = EagerConsumer(channel, queues=[Queue("q")], auto_declare=False, on_message=lambda m: None)
    consumer.consume()
    [tag] = consumer._active_tags.values()
    assert channel.registered_at_consume == {tag: consumer._receive_callback}
    assert channel.callbacks == {tag: consumer._receive_callback}
