"""A reader's records on the broker, read and written from outside its worker (``log status``, ``log rewind``):
its position, read without changing it (got and put back: the queue is classic, which counts nothing), and a
rewind request, published (persistent, confirmed) to its lock queue, where the worker that reads takes it."""
from __future__ import annotations

__all__ = ["peek_position", "request_rewind"]

import logging
from typing import Any

import amqp
from amqp.exceptions import NotFound

from ..core.readers import REWIND_HEADER, Position, Reader, Rewind
from .declare import close_quietly

logger = logging.getLogger(__name__)


def peek_position(connection: Any, reader: Reader) -> Position | None:
    """The reader's written position, or None (none written yet, unreadable, or its queue missing)."""
    channel = connection.channel()
    try:
        got = channel.basic_get(reader.position_queue, no_ack=False)
        if got is None:
            return None
        try:
            return Position.parse(got.body)
        except ValueError as exc:
            logger.warning("kombu-events: the position of reader %s cannot be read: %s", reader.name, exc)
            return None
        finally:
            channel.basic_reject(got.delivery_tag, requeue=True)
    except NotFound:
        return None
    finally:
        close_quietly(channel)


def request_rewind(connection: Any, reader: Reader, rewind: Rewind) -> None:
    """Publish ``rewind`` to the reader's lock queue (persistent, confirmed; NotFound if the queue is missing)."""
    channel = connection.channel()
    try:
        channel.queue_declare(reader.queue, passive=True)
        message = amqp.Message(rewind.body(), content_type="application/json", delivery_mode=2,
                               application_headers={REWIND_HEADER: reader.name})
        channel.basic_publish_confirm(message, exchange="", routing_key=reader.queue, confirm_timeout=10)
    finally:
        close_quietly(channel)
