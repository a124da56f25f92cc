"""Helpers of the console's integration tests: a service of its own, an archive seeded directly, a console."""
from __future__ import annotations

import base64
from typing import Any, Iterator

import amqp
from celery import Celery
from kombu import Connection

from kombu_events import Events
from kombu_events.broker.declare import declare
from kombu_events.core import headers as wire

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

    def queue(self, name: str) -> str:
        return f"{self.service}.{name}"

    def archive(self, messages: list[tuple[str, str, str, bytes]], *, confirm: bool = True) -> list[str]:
        """Archive (handler, routing key, exception, body) messages as the worker would; their ids.

        ``confirm=False`` (a benchmark's thousands): no wait per message; the caller waits for the depth.
        """
        ids = []
        conn = amqp.Connection(_host(self.broker_url), userid="guest", password="guest", confirm_publish=confirm)
        conn.connect()
        try:
            channel = conn.channel()
            for handler, key, exception, body in messages:
                message_id = unique("m")
                headers = wire.archive_headers({}, attempt=3, queue=self.queue(handler), routing_key=key,
                                               reason=f"gave up after 3 attempts: {exception}",
                                               exception=exception, traceback=f"Traceback ...\n{exception}\n")
                channel.basic_publish(amqp.Message(body, message_id=message_id, content_type="application/json",
                                                   delivery_mode=2, application_headers=headers),
                                      exchange=self.events.topology().archive_exchange, routing_key="")
                ids.append(message_id)
        finally:
            conn.close()
        return ids

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
