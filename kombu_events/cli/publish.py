"""The ``publish`` command: one JSON event, confirmed and mandatory, now or after ``--delay`` seconds, to the
``-A`` app service's exchange or, without an app, to ``events`` (or ``--exchange``) on ``--broker`` or
``RABBIT_URL``; it prints the event's message id."""
from __future__ import annotations

import dataclasses
import json

import click

from ..core.config import Settings, broker_url
from ..core.topology import build_topology
from ..errors import KombuEventsError
from ..publishing.publisher import Publisher, addressed, build_message
from .common import Context, examples, guarded


@click.command()
@click.argument("routing_key")
@click.argument("payload")
@click.option("--exchange", help="Exchange (default: the service's, else 'events').")
@click.option("--delay", type=click.FloatRange(min=0), default=0, show_default=True,
              help="Seconds the event waits in the broker before it goes to every queue bound for its key.")
@click.pass_obj
@guarded
def publish(obj: Context, routing_key: str, payload: str, exchange: str | None, delay: float) -> None:
    """Publish one JSON event (confirmed, mandatory), now or after --delay seconds."""
    try:
        data = json.loads(payload)
    except ValueError as exc:
        raise KombuEventsError(f"PAYLOAD is not valid JSON: {exc}") from exc
    if obj.app_name:
        settings, url = obj.events.settings, obj.url
    else:
        settings, url = Settings(service="kombu-events"), broker_url(None, obj.broker)
    if exchange:
        settings = dataclasses.replace(settings, exchange=exchange)
    message = build_message(data)
    target, key = addressed(build_topology(settings, ()), routing_key, message, delay)
    publisher = Publisher(url)
    try:
        publisher.publish(target, key, message)
    finally:
        publisher.close()
    click.echo(message.properties["message_id"])


examples(publish,
         "kombu-events publish orders.7.created '{\"order_id\": 7}'              # to 'events' on RABBIT_URL",
         "kombu-events publish --delay 30 orders.7.remind '{\"order_id\": 7}'    # every subscriber, in 30 s",
         "kombu-events -A proj.events publish billing.invoice.paid '{\"id\": 7}'  # to the service's exchange")
