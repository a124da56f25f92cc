"""The AsyncAPI 3.0 document of a service (``kombu-events asyncapi``): what it receives and sends; no I/O.

The channels: the events exchange (``is: routingKey``, address null: each event picks its own routing key),
and one per handler queue (``is: queue``, address the queue's name, its binding keys in
``x-kombu-events-bindings``). A handler's channel holds one message per form an event arrives in, since the
worker unwraps them all: the bare message, and a CloudEvent in structured mode (``application/cloudevents+json``,
the payload under ``data``) and in binary mode (the attributes in ``ce-*`` headers); a ``type=`` handler's type
is the AMQP ``type`` property of the bare form (``messageType``) and the CloudEvents ``type`` attribute of the
others (a ``const`` in their schemas). The operations: ``receive`` per handler, its retry ladder and archive in
prose and in ``x-kombu-events-retry`` / ``x-kombu-events-archive``, the dedup key of a ``once=`` handler in
``x-kombu-events-once``; ``send`` per declared publication, on the events exchange, its pattern in
``x-kombu-events-routing-key``, at least once through the outbox (``x-kombu-events-delivery``). Payloads are
the contracts' JSON Schemas in AsyncAPI's default schema format (JSON Schema draft 07 and more): pydantic's
draft 2020-12 is rewritten to it (:mod:`kombu_events.ops.json_schema`), its ``$defs`` moved to
``components/schemas``; the YAML is written by :mod:`kombu_events.ops.yaml_text`. Names, durability and
arguments come from the service's topology, the one place that builds them. Periodic schedules are the
service's own business and are left out; so is every credential of the broker URL (user name included).
"""
from __future__ import annotations

__all__ = ["ASYNCAPI", "FORMATS", "Service", "document", "render"]

import dataclasses
import inspect
from typing import Any, Callable, Protocol
from urllib.parse import quote

from kombu.utils.url import parse_url

from ..core import ladder
from ..core.config import Settings
from ..core.contracts import Contract, Publication
from ..core.event_log import EventLog
from ..core.handlers import Handler
from ..core.topology import Topology
from ..errors import DelayTooLongError
from .asyncapi_forms import OUTBOX, binary, dedup, dedup_note, once_key, qualified, structured
from .json_schema import Schemas, component_key, unique_key
from .yaml_text import to_json, to_yaml

ASYNCAPI = "3.0.0"
FORMATS = ("yaml", "json")
_AMQP = "0.3.0"  # the AMQP bindings' version
_SECURITY = "user-password"
_EXCHANGE = "events-exchange"  # the key of the events exchange's channel


class Service(Protocol):
    """What the document is made of: an :class:`~kombu_events.Events` service."""

    @property
    def service(self) -> str: ...
    @property
    def broker_url(self) -> str: ...
    @property
    def settings(self) -> Settings: ...
    @property
    def handlers(self) -> tuple[Handler, ...]: ...
    @property
    def publications(self) -> tuple[Publication, ...]: ...
    @property
    def outbox(self) -> object | None: ...
    def topology(self) -> Topology: ...


def document(service: Service, *, broker_url: str | None = None, version: str = "1.0.0") -> dict[str, Any]:
    """The AsyncAPI 3.0.0 document of ``service`` as JSON-ready data, the same for the same service.

    ``broker_url`` (default: the service's) gives the servers, without credentials; ``version`` is
    ``info.version``: the version of the service's events, which kombu-events cannot know.
    """
    settings, topology = service.settings, service.topology()
    url = broker_url or service.broker_url
    vhost = _vhost(url)
    build = _Build(topology, vhost, outbox=service.outbox is not None)
    handlers = sorted((h for h in service.handlers if topology.role(h.queue) == "handler"), key=lambda h: h.queue)
    for handler in handlers:
        build.handler(handler)
    for publication in sorted(service.publications, key=lambda p: (p.pattern, p.contract.name)):
        build.publication(publication)
    for log in topology.logs:
        build.log(log)
    return {
        "asyncapi": ASYNCAPI,
        "info": {"title": service.service, "version": version,
                 "description": _info(service.service, settings, len(handlers) < len(service.handlers))},
        "defaultContentType": "application/json",
        "servers": _servers(url),
        "channels": {_EXCHANGE: build.exchange_channel(), **build.channels},
        "operations": build.operations,
        "components": {"messages": dict(sorted(build.messages.items())),
                       "schemas": dict(sorted(build.schemas.found.items())),
                       "securitySchemes": {_SECURITY: {
                           "type": "userPassword",
                           "description": "The broker's user name and password (not in this document)."}}},
    }


def _info(name: str, settings: Settings, schedules: bool) -> str:
    text = (f"The events of the kombu-events service `{name}`, generated from its code by "
            f"`kombu-events asyncapi`: each handler receives from a queue of its own, bound to the topic "
            f"exchange `{settings.exchange}` with its binding keys; each publication the service declared "
            f"(`events.publishes`) is sent to that exchange. Payloads are JSON, checked against the "
            f"handler's or publication's type where it has one. A handler's channel lists each form its events "
            f"may arrive in: a bare JSON message, or a CloudEvent in structured or binary mode, which the worker "
            f"unwraps (MassTransit, NServiceBus and Spring AMQP envelopes too: docs/contracts.md).\n\n"
            f"`info.version` is the version given to the command (`--api-version`, default 1.0.0): kombu-events "
            f"does not know your service's.")
    if schedules:
        text += "\n\nThe service's periodic schedules use queues of their own, fed by no publisher: not shown."
    return text


class _Build:
    """The channels, operations, messages and schemas of one document, keyed and referenced."""

    def __init__(self, topology: Topology, vhost: str, *, outbox: bool = False) -> None:
        self.topology, self.vhost, self.settings, self.outbox = topology, vhost, topology.settings, outbox
        self.channels: dict[str, Any] = {}
        self.operations: dict[str, Any] = {}
        self.messages: dict[str, Any] = {}
        self.published: dict[str, Any] = {}  # the events exchange channel's messages
        self.schemas = Schemas()

    def exchange_channel(self) -> dict[str, Any]:
        """The events exchange: every event goes through it, with its own routing key."""
        exchange = next(e for e in self.topology.exchanges if e.name == self.settings.exchange)
        return {
            "address": None, "title": f"exchange {exchange.name}",
            "description": (f"The {exchange.type} exchange `{exchange.name}`: publishers send every event to it "
                            f"with the event's routing key (e.g. `orders.42.created`). The address is null: "
                            f"each event has its own; the send operations give the pattern of theirs."),
            "messages": self.published,
            "bindings": {"amqp": {"is": "routingKey", "exchange": {
                "name": exchange.name, "type": exchange.type, "durable": bool(exchange.durable),
                "autoDelete": bool(exchange.auto_delete), "vhost": self.vhost}, "bindingVersion": _AMQP}},
        }

    def handler(self, handler: Handler) -> None:
        """A channel for the handler's queue, a message, a receive operation."""
        queue = next(q for q in self.topology.queues if q.name == handler.queue)
        keys = sorted(b.routing_key for b in queue.bindings if b.exchange.name == self.settings.exchange)
        channel = unique_key(component_key(handler.queue), {*self.channels, _EXCHANGE})
        messages = self._forms(handler)
        self.channels[channel] = self._queue_channel(queue, keys, messages)
        retry, archive = _retry(handler, self.settings), self._archive(handler)
        self.operations[unique_key(component_key(handler.name), self.operations)] = {
            "action": "receive", "channel": {"$ref": f"#/channels/{channel}"},
            "messages": [{"$ref": f"#/channels/{channel}/messages/{m}"} for m in messages],
            "summary": _first_line(handler.fn) or f"Handles the events bound with {', '.join(keys)}.",
            "description": _handling(handler, keys, retry, archive, self.settings.exchange),
            "bindings": {"amqp": {"ack": True, "bindingVersion": _AMQP}},
            "x-kombu-events-handler": qualified(handler.fn),
            "x-kombu-events-message-type": handler.message_type,
            "x-kombu-events-once": once_key(handler),
            "x-kombu-events-retry": retry, "x-kombu-events-archive": archive,
        }

    def _forms(self, handler: Handler) -> list[str]:
        """The keys of the handler's messages: the bare one, then (unless raw=True, which unwraps nothing)
        the CloudEvents forms of the same payload."""
        bare = self._message(handler.name, handler.contract, handler, where=f"handler {handler.name!r}")
        keys = [unique_key(component_key(handler.name), self.messages)]
        self.messages[keys[0]] = bare
        if not handler.raw:
            for suffix, form in (("cloudevents", structured), ("cloudevents-binary", binary)):
                keys.append(unique_key(f"{keys[0]}.{suffix}", self.messages))
                self.messages[keys[-1]] = form(bare, handler)
        return keys

    def _queue_channel(self, queue: Any, keys: list[str], messages: list[str]) -> dict[str, Any]:
        # "{x}" in an address is a parameter, and AsyncAPI has no escape for it: such a name is in the binding only
        address = None if "{" in queue.name or "}" in queue.name else queue.name
        return {
            "address": address, "title": f"queue {queue.name}",
            "summary": f"Bound to exchange {self.settings.exchange} with " + ", ".join(keys) + ".",
            "messages": {m: {"$ref": f"#/components/messages/{m}"} for m in messages},
            "bindings": {"amqp": {"is": "queue", "queue": {
                "name": queue.name, "durable": bool(queue.durable), "exclusive": bool(queue.exclusive),
                "autoDelete": bool(queue.auto_delete), "vhost": self.vhost}, "bindingVersion": _AMQP}},
            "x-kombu-events-bindings": [{"exchange": self.settings.exchange, "routingKey": k} for k in keys],
            "x-kombu-events-arguments": dict(sorted((queue.queue_arguments or {}).items())),
        }

    def log(self, log: EventLog) -> None:
        """A channel for a log's stream, with no operation: the broker appends to it, nothing receives from it yet."""
        queue = next(q for q in self.topology.queues if q.name == log.queue)
        channel = self._queue_channel(queue, list(log.binding_keys), [])
        kept = " and ".join(filter(None, [f"for {_duration(log.keep_s * 1000)}" if log.keep_s else "",
                                          f"up to {_size(log.max_bytes)}" if log.max_bytes else ""]))
        channel.update({"title": f"log {log.name}", "description": (
            f"The log `{log.name}`: the RabbitMQ stream `{log.queue}` keeps every event of its binding keys, "
            f"whoever published it, in the order the broker took them, {kept} (whole segments of "
            f"{_size(log.segment_bytes)} are removed). `kombu-events log status` shows its offsets."),
            "x-kombu-events-log": {"name": log.name, "maxAge": log.queue_arguments().get("x-max-age"),
                                   "maxBytes": log.max_bytes, "segmentBytes": log.segment_bytes}})
        del channel["messages"]
        self.channels[unique_key(component_key(log.queue), {*self.channels, _EXCHANGE})] = channel

    def publication(self, publication: Publication) -> None:
        """A message on the events exchange channel, a send operation."""
        name = "publish." + component_key(publication.pattern.replace("*", "star").replace("#", "hash"))
        message = unique_key(name, self.messages)
        self.messages[message] = self._message(publication.contract.name, publication.contract, None,
                                               where=f"publication {publication.pattern!r}")
        self.published[message] = {"$ref": f"#/components/messages/{message}"}
        contract = publication.contract.name
        self.operations[unique_key(name, self.operations)] = {
            "action": "send", "channel": {"$ref": f"#/channels/{_EXCHANGE}"},
            "messages": [{"$ref": f"#/channels/{_EXCHANGE}/messages/{message}"}],
            "summary": f"Sends {contract} events, routing keys matching {publication.pattern}.",
            "description": (f"`events.publish(key, payload)` with a key matching `{publication.pattern}` (`*` one "
                            f"word, `#` zero or more) refuses a payload that does not fit {contract}, before "
                            f"sending. Sent persistent (delivery mode 2), `mandatory` (an event no queue is bound "
                            f"for is an error) and confirmed by the broker." + (OUTBOX if self.outbox else "")),
            "bindings": {"amqp": {"deliveryMode": 2, "bindingVersion": _AMQP}},
            "x-kombu-events-routing-key": publication.pattern,
            **({"x-kombu-events-delivery": "at-least-once"} if self.outbox else {}),
        }

    def _message(self, name: str, contract: Contract | None, handler: Handler | None, *,
                 where: str) -> dict[str, Any]:
        message: dict[str, Any] = {"name": contract.name if contract else name, "contentType": "application/json"}
        if contract is not None:
            message["payload"] = self.schemas.add(contract, where=where)
        elif handler is not None and handler.raw:
            message["description"] = "The body's bytes, as sent: the handler decodes them (raw=True)."
            del message["contentType"]
        else:
            message["payload"] = {"description": "Any JSON: the handler's parameter has no type, nothing is checked."}
        if handler is not None and handler.message_type is not None:
            message["bindings"] = {"amqp": {"messageType": handler.message_type, "bindingVersion": _AMQP}}
        if handler is not None and handler.once:
            message["description"] = " ".join(filter(None, [message.get("description"),
                                                            dedup_note(handler, cloudevent=False)]))
        return message

    def _archive(self, handler: Handler) -> dict[str, Any]:
        exchange = self.topology.archive_exchange
        queue = next(q for q in self.topology.queues if q.name == exchange)
        arguments = getattr(queue, "queue_arguments", None) or {}
        at_once = ["raise Archive(...)", "an exception inside `with poisonous():`",
                   "a body that does not decode, or a content type not accepted"]
        if handler.contract is not None:
            at_once.insert(0, f"a payload that does not fit {handler.contract.name}")
        at_once += [f"raise {qualified(kind)}" for kind in handler.dont_retry]
        max_age = str(arguments.get("x-max-age") or "")
        return {"exchange": exchange, "queue": queue.name, "type": "stream",
                "maxAgeMs": int(max_age[:-1]) * 1000 if max_age.endswith("s") else None,
                "maxBytes": arguments.get("x-max-length-bytes"), "archivedAtOnce": at_once}


def _size(n: int) -> str:
    """``n`` bytes as a reader says it: 1 GiB, 512 MiB, 1000 bytes."""
    for unit, size in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if n >= size and n % size == 0:
            return f"{n // size} {unit}"
    return f"{n} bytes"


def _handling(handler: Handler, keys: list[str], retry: dict[str, Any], archive: dict[str, Any],
              exchange: str) -> str:
    """The receive operation's description: what runs, when it is retried, when it is archived."""
    steps = ", ".join(_duration(ms) for ms in retry["delaysMs"])
    if len(retry["delaysMs"]) < retry["maxRetries"]:
        steps += f", then {_duration(retry['delaysMs'][-1])} for each further retry"
    text = [(f"Runs `{qualified(handler.fn)}` in a Celery worker for each event routed to queue "
             f"`{handler.queue}` (exchange `{exchange}`, binding keys {', '.join(f'`{k}`' for k in keys)}); "
             f"the message is acked once it returns.")]
    if handler.message_type is not None:
        text.append(f"Only events of message type `{handler.message_type}` run it: the CloudEvents `type` "
                    f"attribute of a CloudEvent (MassTransit's, NServiceBus's or Spring's type name in their "
                    f"envelopes), the AMQP `type` property of a bare message. The others are acked without "
                    f"running it.")
    if handler.contract is not None:
        text.append(f"The payload must fit `{handler.contract.name}` (the schema below).")
    if handler.once:
        text.append("Effectively once (`once=`): " + dedup(handler, "its `message_id` property"))
    if retry["maxRetries"]:
        jitter = retry["backoff"].get("jitter") or 0
        spread = f" (each drawn from {1 - jitter:g}-1 times that: jitter {jitter:g})" if jitter else ""
        text.append(f"A failure is retried up to {retry['maxRetries']} times, after {steps}{spread}: the broker "
                    f"holds each retry in the service's delay ladder, then brings it back to this queue only.")
    else:
        text.append("A failure is not retried (max_retries=0).")
    limits = [f"each kept {_duration(archive['maxAgeMs'])}" if archive["maxAgeMs"] else "",
              f"at most {_size(archive['maxBytes'])} in all" if archive["maxBytes"] else ""]
    kept = " and ".join(x for x in limits if x)
    text.append(f"After the last attempt it goes to the archive, stream `{archive['queue']}`"
                + (f" ({kept})" if kept else "") + ", where `kombu-events archive` lists and replays it. "
                "Archived at once, without a retry: " + "; ".join(archive["archivedAtOnce"]) + ".")
    return "\n\n".join(text)


def _retry(handler: Handler, settings: Settings) -> dict[str, Any]:
    """``x-kombu-events-retry``: the policy, and the delays the ladder holds (whole units, rounded up)."""
    backoff = handler.backoff
    policy: dict[str, Any] = {"policy": type(backoff).__name__}
    if dataclasses.is_dataclass(backoff):
        values = {_camel(f.name): getattr(backoff, f.name) for f in dataclasses.fields(backoff)}
        policy.update({k: v for k, v in values.items() if v is None or isinstance(v, (bool, int, float, str))})
    delays: list[int] = []
    previous = None
    for retry in range(1, min(handler.max_retries, 64) + 1):
        delay = backoff.delay_ms(retry=retry, rand=lambda: 0.0)  # no jitter: the longest
        if delay == previous:
            break  # the same from here on (capped, or constant)
        previous = delay
        try:
            units = ladder.units_for(delay_ms=delay, unit_ms=settings.delay_unit_ms, levels=settings.delay_levels)
        except DelayTooLongError:
            break  # the worker archives such a retry: its description says so
        delays.append(units * settings.delay_unit_ms)
    return {"maxRetries": handler.max_retries, "backoff": policy, "delaysMs": delays,
            "delayUnitMs": settings.delay_unit_ms,
            "retryFor": [qualified(kind) for kind in handler.retry_for]}


def _servers(url: str) -> dict[str, Any]:
    """One server per URL of ``url`` (kombu's fail-over URLs are ``;``-separated); host, port, vhost only."""
    servers: dict[str, Any] = {}
    for one in (u.strip() for u in url.split(";") if u.strip()):
        parts = parse_url(one)
        tls = parts["transport"] == "amqps"
        host = parts["hostname"] or "localhost"
        host = f"[{host}]" if ":" in host else host
        vhost = parts["virtual_host"] or "/"
        key = unique_key("rabbitmq", servers)
        servers[key] = {
            "host": f"{host}:{parts['port'] or (5671 if tls else 5672)}", "protocol": "amqps" if tls else "amqp",
            "protocolVersion": "0.9.1", "pathname": "/" + quote(vhost, safe=""), "title": "RabbitMQ",
            "description": (f"Virtual host `{vhost}` (the pathname is the vhost, URL-encoded as in an AMQP URI). "
                            f"The user name and password are not part of this document."),
            "security": [{"$ref": f"#/components/securitySchemes/{_SECURITY}"}],
        }
    return servers


def _vhost(url: str) -> str:
    first = next((u.strip() for u in url.split(";") if u.strip()), "")
    return str(parse_url(first)["virtual_host"] or "/") if first else "/"




def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(word.capitalize() for word in rest)


def _first_line(fn: Callable[..., Any]) -> str:
    doc = inspect.getdoc(fn) or ""
    return doc.strip().split("\n", 1)[0].strip()


def _duration(ms: float) -> str:
    """``1 s``, ``250 ms``, ``2 h``, ``7 d``: the largest unit that divides ``ms``; else ms."""
    for unit, size in (("d", 86_400_000), ("h", 3_600_000), ("min", 60_000), ("s", 1000)):
        if ms >= size and ms % size == 0:
            return f"{int(ms // size)} {unit}"
    return f"{ms:g} ms"


def render(doc: dict[str, Any], fmt: str) -> str:
    """``doc`` as ``yaml`` or ``json`` text, ending with a newline."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}: use one of {', '.join(FORMATS)}")
    return to_yaml(doc) if fmt == "yaml" else to_json(doc)
