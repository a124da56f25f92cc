"""Broker-side helpers of the runner: declare, fill, inspect and delete what a run uses."""
from __future__ import annotations

import os
import shlex
import subprocess
import uuid
from datetime import datetime, timedelta, timezone
from typing import Any, Iterable

from amqp import Message
from amqp.exceptions import NotFound
from kombu import Connection, Exchange, Queue
from kombu.serialization import dumps

from kombu_events.broker.declare import declare
from kombu_events.publishing.publisher import Publisher, build_message

CHUNK = 1000  # messages per pipelined publish_many call while filling queues


def unique(prefix: str) -> str:
    """A name no other run uses."""
    return f"{prefix}{uuid.uuid4().hex[:8]}"


def depth(url: str, queue: str) -> int | None:
    """Ready messages in ``queue`` (None if it does not exist)."""
    with Connection(url) as conn:
        try:
            return conn.default_channel.queue_declare(queue, passive=True)[1]
        except NotFound:
            return None


def depths(url: str, queues: Iterable[str]) -> dict[str, int | None]:
    """Ready messages of each queue, on one connection."""
    result: dict[str, int | None] = {}
    with Connection(url) as conn:
        for queue in queues:
            channel = conn.channel()
            try:
                result[queue] = channel.queue_declare(queue, passive=True)[1]
            except NotFound:
                result[queue] = None
            finally:
                try:
                    channel.close()
                except Exception:  # NotFound already closed it
                    pass
    return result


def declare_events(url: str, events) -> None:
    """Declare a service's whole topology, as the worker and ``kombu-events declare`` do."""
    with Connection(url) as conn:
        declare(events.topology(), conn)


def declare_queue(url: str, name: str, exchange: str | None = None, routing_key: str = "") -> None:
    """A durable classic queue, bound to topic ``exchange`` with ``routing_key`` if given."""
    with Connection(url) as conn:
        channel = conn.default_channel
        if exchange:
            Exchange(exchange, "topic", durable=True)(channel).declare()
            Queue(name, Exchange(exchange, "topic", durable=True), routing_key=routing_key,
                  durable=True)(channel).declare()
        else:
            Queue(name, durable=True)(channel).declare()


def publish(url: str, items: list[tuple[str, str, Message]]) -> None:
    """Publish ``(exchange, routing_key, message)`` with pipelined confirms; raise on any failure."""
    publisher = Publisher(url)
    try:
        for start in range(0, len(items), CHUNK):
            errors = [e for e in publisher.send_many(items[start:start + CHUNK]) if e is not None]
            if errors:
                raise errors[0]
    finally:
        publisher.close()


#: ``placed_at`` of :func:`order_payload` ``i`` is this plus ``i`` seconds.
ORDER_EPOCH = datetime(2026, 11, 25, 8, 0, tzinfo=timezone.utc)
CURRENCIES = ("EUR", "USD", "GBP", "CHF")


def order_payload(i: int) -> dict:
    """A 5-field order event (``i`` stays the probe's id), the payload ``benchmarks.apps.orders.Order5`` fits."""
    return {"i": i, "order_id": f"ord-{i:08d}", "amount": round(5 + (i % 10_000) * 0.37, 2),
            "currency": CURRENCIES[i % len(CURRENCIES)], "placed_at": (ORDER_EPOCH + timedelta(seconds=i)).isoformat()}


def event_messages(exchange: str, keys: list[str], n: int, first: int = 0, fields: int = 1,
                   **extra) -> list[tuple[str, str, Message]]:
    """``n`` distinct JSON events ``{"i": i}`` spread round-robin over routing ``keys``.

    ``fields=5``: each payload is :func:`order_payload` ``(i)`` instead (5 fields, ``extra`` added).
    """
    if fields not in (1, 5):
        raise ValueError(f"fields must be 1 ({{'i': i}}) or 5 (order_payload), got {fields!r}")
    body = order_payload if fields == 5 else (lambda i: {"i": i})
    return [(exchange, keys[i % len(keys)], build_message({**body(i), **extra})) for i in range(first, first + n)]


def celery_messages(app, task: str, queue: str, n: int, kwargs: dict | None = None,
                    **options) -> list[tuple[str, str, Message]]:
    """``n`` Celery task messages (protocol 2, JSON, persistent) calling ``task(i, **kwargs)``.

    ``options`` go to Celery's own message builder (``countdown=``, ``retries=``).
    """
    items = []
    for i in range(n):
        task_id = uuid.uuid4().hex
        headers, properties, body, _sent = app.amqp.as_task_v2(task_id, task, args=(i,), kwargs=kwargs or {},
                                                                **options)
        content_type, encoding, data = dumps(body, "json")
        message = Message(data, content_type=content_type, content_encoding=encoding, delivery_mode=2,
                          application_headers=headers, **properties)
        items.append(("", queue, message))
    return items


def delete(url: str, queues: Iterable[str] = (), exchanges: Iterable[str] = ()) -> None:
    """Delete queues and exchanges (missing ones are fine)."""
    with Connection(url) as conn:
        for name in queues:
            conn.default_channel.queue_delete(name)
        for name in exchanges:
            conn.default_channel.exchange_delete(name)


def delete_service(url: str, topologies: Iterable[Any], service: str) -> None:
    """Delete every queue and exchange of ``topologies`` and the Celery task queue of ``service``."""
    queues, exchanges = [f"{service}.tasks"], [f"{service}.tasks"]
    for topology in topologies:
        queues += [queue.name for queue in topology.queues]
        exchanges += [exchange.name for exchange in topology.exchanges]
    delete(url, queues, exchanges)


def rabbitmqctl() -> list[str]:
    """The command that runs rabbitmqctl against the broker of the run: ``KEB_RABBITMQCTL`` (or the test suite's
    ``KOMBU_EVENTS_TEST_RABBITMQCTL``, as ``scripts/rabbitmq4-node env`` sets it), else the host's."""
    command = os.environ.get("KEB_RABBITMQCTL") or os.environ.get("KOMBU_EVENTS_TEST_RABBITMQCTL")
    return shlex.split(command) if command else ["rabbitmqctl"]


def leftovers(prefix: str) -> tuple[list[str], list[str]]:
    """Queues and exchanges on the broker whose name starts with ``prefix``."""
    def names(what: str) -> list[str]:
        out = subprocess.run([*rabbitmqctl(), "-q", f"list_{what}", "name"], capture_output=True, text=True,
                             timeout=60).stdout
        return [n for n in out.split() if n.startswith(prefix)]
    return names("queues"), names("exchanges")
