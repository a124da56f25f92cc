"""The forms a handler's events arrive in, as AsyncAPI messages, and what delivery promises to say of them.

The worker unwraps CloudEvents for every handler but ``raw=True`` ones, so besides the bare message a handler
receives a CloudEvent in structured mode (``application/cloudevents+json``, the payload under ``data``) and in
binary mode (the attributes in ``ce-*`` headers, the payload the body); a ``type=`` handler's type is their
CloudEvents ``type`` attribute, a ``const`` of their schemas. A ``once=`` handler's dedup key (the AMQP
``message_id``, which publishers must keep on a retry) and the outbox's at-least-once delivery are said in
words and in extensions. Pure: used by :mod:`.asyncapi`.
"""
from __future__ import annotations

__all__ = ["OUTBOX", "binary", "dedup", "dedup_note", "once_key", "qualified", "structured"]

from typing import Any

from ..core.handlers import Handler


def qualified(obj: Any) -> str:
    """``module.qualname`` of a function or class; else the type's."""
    target = obj if hasattr(obj, "__qualname__") else type(obj)
    return f"{getattr(target, '__module__', '?')}.{target.__qualname__}"


#: A send operation's delivery through the transactional outbox (docs/effectively-once.md).
OUTBOX = (" The service publishes through its transactional outbox: an event published inside a database "
          "transaction is sent by a relay after the commit, and delivered **at least once**: a relay that dies "
          "between the broker's confirm and deleting its row sends it again, with the same `message_id` and body. "
          "Receivers deduplicate by `message_id` (kombu-events: `once=True`).")

#: CloudEvents in AMQP 0.9.1 (no official binding): the header prefixes the worker reads, the first the usual one.
_CE_PREFIXES = ("ce-", "ce_", "cloudEvents_", "cloudEvents:")


def once_key(handler: Handler) -> dict[str, Any] | None:
    """``x-kombu-events-once``: the inbox's dedup key of a ``once=`` handler; None without ``once``."""
    if not handler.once:
        return None
    if callable(handler.once) and not isinstance(handler.once, bool):
        return {"key": qualified(handler.once), "stableOnRetries": True}
    return {"key": "message_id", "withoutMessageId": "sha256 of the routing key and the body",
            "stableOnRetries": True}


def dedup(handler: Handler, where: str, *, cloudevent: bool = True) -> str:
    """What a ``once=`` handler deduplicates by, and what that asks of publishers (of CloudEvents too)."""
    if callable(handler.once) and not isinstance(handler.once, bool):
        return (f"deduplicated by the key `{qualified(handler.once)}` returns: an event sent again (a publisher's "
                f"retry) must give the same key, or the handler runs again.")
    text = (f"deduplicated by {where}: a publisher that sends an event again (a retry) must keep its "
            f"`message_id`, or the handler runs again. A message without one is keyed by a hash of its routing key "
            f"and body.")
    return text + (" For a CloudEvent too it is the AMQP property, not the CloudEvents `id`: set it to the id."
                   if cloudevent else "")


def dedup_note(handler: Handler, before: str = "", *, cloudevent: bool = True) -> str:
    """A message's sentence on its dedup key (``once=`` handlers), after ``before``; "" otherwise."""
    if not handler.once:
        return ""
    return before + "Effectively once: " + dedup(handler, "the AMQP `message_id` property", cloudevent=cloudevent)


def _type_schema(handler: Handler) -> dict[str, Any]:
    """The CloudEvents ``type`` attribute: a ``type=`` handler's type, else any non-empty string."""
    if handler.message_type is None:
        return {"type": "string", "minLength": 1}
    return {"const": handler.message_type,
            "description": "The handler runs only for this type (others are acked without running it)."}


def structured(bare: dict[str, Any], handler: Handler) -> dict[str, Any]:
    """The handler's event as a CloudEvent in structured mode: the attributes and the payload in one JSON object."""
    data = bare.get("payload", {})
    payload = {
        "type": "object", "required": ["specversion", "id", "source", "type"],
        "properties": {"specversion": {"const": "1.0"}, "id": {"type": "string", "minLength": 1},
                       "source": {"type": "string", "minLength": 1}, "type": _type_schema(handler),
                       "time": {"type": "string", "format": "date-time"}, "datacontenttype": {"type": "string"},
                       "data": data, "data_base64": {"type": "string", "contentEncoding": "base64",
                                                     "description": "Instead of data: bytes the worker decodes "
                                                                    "as datacontenttype says (JSON if unset)."}},
        "not": {"required": ["data", "data_base64"]},
    }
    return {"name": bare["name"], "title": f"{bare['name']} as a CloudEvent (structured mode)",
            "contentType": "application/cloudevents+json", "payload": payload,
            "description": ("A CloudEvent (specversion 1.0) whose attributes and payload are one JSON object, "
                            "content type `application/cloudevents+json`: the handler gets its `data`."
                            + dedup_note(handler, " ")),
            "x-kombu-events-envelope": "cloudevents-structured"}


def binary(bare: dict[str, Any], handler: Handler) -> dict[str, Any]:
    """The handler's event as a CloudEvent in binary mode: the attributes in ``ce-*`` headers, the payload the body."""
    names = ("specversion", "id", "source", "type")
    headers = {"type": "object", "required": [f"ce-{n}" for n in names], "properties": {
        "ce-specversion": {"const": "1.0"}, "ce-id": {"type": "string", "minLength": 1},
        "ce-source": {"type": "string", "minLength": 1}, "ce-type": _type_schema(handler),
        "ce-time": {"type": "string", "format": "date-time"}}}
    message = {key: value for key, value in bare.items() if key not in ("bindings", "description")}
    message.update({
        "title": f"{bare['name']} as a CloudEvent (binary mode)", "headers": headers,
        "description": ("A CloudEvent (specversion 1.0) in binary mode: its attributes are AMQP headers `ce-id`, "
                        f"`ce-type`, ... (the prefixes {', '.join(f'`{p}`' for p in _CE_PREFIXES)} are all read), "
                        "the body is the payload, in the message's content type." + dedup_note(handler, " ")),
        "x-kombu-events-envelope": "cloudevents-binary"})
    return message
