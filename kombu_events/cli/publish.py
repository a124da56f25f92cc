"""The ``publish`` command: one JSON event, confirmed and mandatory, now or after ``--delay`` seconds, to the
``-A`` app service's exchange or, without an app, to ``events`` (or ``--exchange``) on ``--broker`` or
``RABBIT_URL``, with the ``--message-id`` and ``--header``\\ s given; it prints the event's message id.

``--header KEY=VALUE`` sets a string header; ``--header KEY:=JSON`` one whose value is JSON (a number, true,
false, null, a list or an object), as HTTPie spells it."""
from __future__ import annotations

import dataclasses
import json
from typing import Any

import click

from ..core.config import Settings, broker_url
from ..core.topology import build_topology
from ..core.wire import PREFIX
from ..errors import KombuEventsError
from ..publishing.publisher import Publisher, addressed, build_message
from .common import Context, emit_json, examples, guarded, json_option

#: AMQP short strings (a message id, a header's name) hold at most 255 bytes.
SHORTSTR_BYTES = 255
_INT64 = 2**63


class HeaderType(click.ParamType):
    """``KEY=VALUE`` (a string) or ``KEY:=JSON`` (any JSON value an AMQP header can hold) -> (key, value)."""

    name = "KEY=VALUE"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, tuple):
            return value
        key, sep, text = str(value).partition("=")
        if not sep:
            self.fail(f"{value!r} is not KEY=VALUE (a string) or KEY:=JSON", param, ctx)
        as_json = key.endswith(":")
        key = key[:-1] if as_json else key
        if not key:
            self.fail(f"{value!r} has no header name before '='", param, ctx)
        if len(key.encode("utf-8")) > SHORTSTR_BYTES:
            self.fail(f"header name {key[:40]!r}... is longer than {SHORTSTR_BYTES} bytes", param, ctx)
        if key.lower().startswith(PREFIX):
            self.fail(f"header {key!r}: names starting with {PREFIX!r} are kombu-events' own", param, ctx)
        if not as_json:
            return key, text
        try:
            parsed = json.loads(text, parse_constant=_no_constant)
        except ValueError as exc:
            self.fail(f"header {key!r}: {text!r} is not JSON ({exc}); for a string, write {key}=VALUE", param, ctx)
        problem = _unsendable(parsed)
        if problem:
            self.fail(f"header {key!r}: {problem}", param, ctx)
        return key, parsed


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number AMQP can send")


def _unsendable(value: Any) -> str | None:
    """Why an AMQP header cannot hold ``value`` (parsed JSON), or None."""
    if isinstance(value, bool) or value is None or isinstance(value, (str, float)):
        return None
    if isinstance(value, int):
        return None if -_INT64 <= value < _INT64 else f"{value} does not fit in a signed 64-bit integer"
    if isinstance(value, list):
        return next((p for p in map(_unsendable, value) if p), None)
    if isinstance(value, dict):
        long_key = next((k for k in value if len(k.encode("utf-8")) > SHORTSTR_BYTES), None)
        if long_key is not None:
            return f"the key {long_key[:40]!r}... is longer than {SHORTSTR_BYTES} bytes"
        return next((p for p in map(_unsendable, value.values()) if p), None)
    return f"{value!r} cannot be sent"  # pragma: no cover -- json.loads makes nothing else


def _message_id(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    if value is not None and not value:
        raise click.BadParameter("must not be empty", ctx, param)
    if value is not None and len(value.encode("utf-8")) > SHORTSTR_BYTES:
        raise click.BadParameter(f"must be at most {SHORTSTR_BYTES} bytes", ctx, param)
    return value


@click.command()
@click.argument("routing_key")
@click.argument("payload")
@click.option("--exchange", help="Exchange (default: the service's, else 'events').")
@click.option("--delay", type=click.FloatRange(min=0), default=0, show_default=True,
              help="Seconds the event waits in the broker before it goes to every queue bound for its key.")
@click.option("--message-id", callback=_message_id, help="The event's message_id (default: a new uuid4 hex).")
@click.option("--header", "headers", type=HeaderType(), multiple=True, metavar="KEY=VALUE|KEY:=JSON",
              help="A header: KEY=VALUE sets a string, KEY:=JSON any JSON value (repeatable).")
@json_option("publish")
@click.pass_obj
@guarded
def publish(obj: Context, routing_key: str, payload: str, exchange: str | None, delay: float,
            message_id: str | None, headers: tuple[tuple[str, Any], ...], as_json: bool) -> None:
    """Publish one JSON event (confirmed, mandatory), now or after --delay seconds."""
    given: dict[str, Any] = {}
    for key, value in headers:
        if key in given:
            raise click.BadParameter(f"header {key!r} given twice", param_hint="'--header'")
        given[key] = value
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
    message = build_message(data, message_id=message_id, headers=given)
    target, key = addressed(build_topology(settings, ()), routing_key, message, delay)
    publisher = Publisher(url, app=obj.app)
    try:
        publisher.send(target, key, message)
    finally:
        publisher.close()
    if as_json:
        emit_json({"message_id": message.properties["message_id"], "exchange": settings.exchange,
                   "routing_key": routing_key, "delay_s": delay, "headers": given})
    else:
        click.echo(message.properties["message_id"])


examples(publish,
         "kombu-events publish orders.7.created '{\"order_id\": 7}'              # to 'events' on RABBIT_URL",
         "kombu-events publish --delay 30 orders.7.remind '{\"order_id\": 7}'    # every subscriber, in 30 s",
         "kombu-events -A proj.events publish billing.invoice.paid '{\"id\": 7}'  # to the service's exchange",
         "kombu-events publish --message-id order-7-created --header x-tenant=acme --header 'x-priority:=3' "
         "orders.7.created '{\"order_id\": 7}'")
