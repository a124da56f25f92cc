"""Helpers of the console's integration tests: a service of its own, an archive (a stream) seeded directly as a
worker archives, and what the stream holds, read by offset (a read changes nothing)."""
from __future__ import annotations

import base64
from typing import Any, Iterator

import amqp
from celery import Celery
from kombu import Connection

from kombu_events import Events
from kombu_events.broker.declare import declare
from kombu_events.core import wire
from kombu_events.core.archive_records import Settlement
from kombu_events.ops.archive import ArchivedMessage, read, records

from ..brokers import HOST, PORT
from .harness import delete_service, unique


class Seeded:
    """An Events service declared on the broker, whose archive is filled without a worker."""

    def __init__(self, broker_url: str, *, handlers: tuple[str, ...] = ("orders", "users"), **settings: Any) -> None:
        self.broker_url = broker_url
        self.service, self.exchange = unique("con"), unique("ex")
        self.app = Celery(self.service, broker=broker_url)
        self.events = Events(self.app, service=self.service, exchange=self.exchange, delay_levels=4, **settings)
        for name in handlers:
            self.events.handler(f"{name}.#", name=name)(lambda event: None)
        with Connection(broker_url) as conn:
            declare(self.events.topology(), conn)
        #: The archive key of each copy archived by :meth:`archive`, by message id (the last copy of an id).
        self.key_of: dict[str, str] = {}

    def queue(self, name: str) -> str:
        return f"{self.service}.{name}"

    def archive(self, messages: list[tuple[str, str, str, bytes]], *, confirm: bool = True,
                ids: list[str] | None = None) -> list[str]:
        """Archive (handler, routing key, exception, body) messages as the worker would, each copy with an
        archive key of its own (:attr:`key_of`); their message ids (``ids``: these, else unique ones).

        ``confirm=False`` (a benchmark's thousands): no wait per message; the caller waits for the stream.
        """
        given, ids = ids, []
        conn = amqp.Connection(_host(self.broker_url), userid="guest", password="guest", confirm_publish=confirm)
        conn.connect()
        try:
            channel = conn.channel()
            for n, (handler, key, exception, body) in enumerate(messages):
                message_id = given[n] if given is not None else unique("m")
                headers = wire.archive_headers({}, attempt=3, queue=self.queue(handler), routing_key=key,
                                               reason=f"gave up after 3 attempts: {exception}",
                                               exception=exception, traceback=f"Traceback ...\n{exception}\n")
                self.key_of[message_id] = headers[wire.ARCHIVE_KEY]
                channel.basic_publish(amqp.Message(body, message_id=message_id, content_type="application/json",
                                                   delivery_mode=2, application_headers=headers),
                                      exchange=self.events.topology().archive_exchange, routing_key="")
                ids.append(message_id)
        finally:
            conn.close()
        return ids

    def records(self) -> list[ArchivedMessage | Settlement]:
        """Every record of the archive stream, in order (copies with their whole bodies, and settlements)."""
        with Connection(self.broker_url) as conn:
            return list(records(conn, self.events.topology()))

    def pending(self) -> list[ArchivedMessage]:
        """The copies still archived (neither replayed nor purged), in stream order, bodies whole."""
        with Connection(self.broker_url) as conn:
            return read(conn, self.events.topology())

    def take(self, name: str) -> list[amqp.Message]:
        """Every ready message of queue ``name`` (acked: taken away)."""
        taken = []
        with Connection(self.broker_url) as conn:
            channel = conn.default_channel
            while (msg := channel.basic_get(self.queue(name), no_ack=True)) is not None:
                taken.append(msg)
        return taken

    def cleanup(self) -> None:
        delete_service(self.broker_url, self.service, (self.exchange,))


def _host(url: str) -> str:
    rest = url.split("@", 1)[-1]
    return rest.split("/", 1)[0] or f"{HOST}:{PORT}"


def basic(user: str, password: str) -> dict[str, str]:
    token = base64.b64encode(f"{user}:{password}".encode()).decode()
    return {"Authorization": f"Basic {token}"}


SAME_ORIGIN = {"Sec-Fetch-Site": "same-origin"}


def seeded(broker_url: str, **settings: Any) -> Iterator[Seeded]:
    service = Seeded(broker_url, **settings)
    try:
        yield service
    finally:
        service.cleanup()
