"""``Delivery``: what the worker read off one message, as plain values; reading it never raises."""
from __future__ import annotations

__all__ = ["Delivery", "read_delivery", "UNREADABLE"]

from collections import abc  # isinstance() against abc.Mapping, not typing.Mapping: faster, for every message
from typing import Any, Mapping, NamedTuple

from ..errors import HeaderError
from . import wire

#: Property the lenient py-amqp decoder (:mod:`kombu_events.broker.lenient_amqp`) sets on a message it
#: could only decode in part; its value says what could not be read.
UNREADABLE = "kombu_events_unreadable"


class Delivery(NamedTuple):
    """One delivery of a message to a handler queue.

    ``routing_key`` is the event's own key (kept through the ladder), ``attempt`` is
    1-based, ``redeliveries`` counts earlier broker redeliveries. ``unreadable``, when
    set, says which header or property could not be read: such a message is archived.
    """

    queue: str
    routing_key: str
    body: bytes = b""
    properties: Mapping[str, Any] = {}
    attempt: int = 1
    redeliveries: int = 0
    redelivered: bool = False
    unreadable: str = ""
    received: float = 0.0

    @property
    def headers(self) -> Mapping[str, Any]:
        """The message's application headers (empty if it has none, or they are not a table)."""
        headers = self.properties.get("application_headers")
        return headers if isinstance(headers, abc.Mapping) else {}

    @property
    def message_id(self) -> Any:
        """The publisher's ``message_id`` property, if it set one."""
        return self.properties.get("message_id")

    @property
    def content_type(self) -> Any:
        """The ``content_type`` property (``None`` when the publisher sent none)."""
        return self.properties.get("content_type")

    @property
    def content_encoding(self) -> Any:
        """The ``content_encoding`` property (``None`` when the publisher sent none)."""
        return self.properties.get("content_encoding")


def read_delivery(
    queue: str, body: Any, properties: Mapping[str, Any], delivery_info: Mapping[str, Any], *, received: float = 0.0
) -> Delivery:
    """Read one delivered message; whatever a publisher sent, this returns a Delivery.

    A header or property that cannot be read does not raise: it is named in
    ``Delivery.unreadable`` and the message goes to the archive.
    """
    key = delivery_info.get("routing_key")
    routing_key = key if isinstance(key, str) else ""
    redelivered = bool(delivery_info.get("redelivered"))
    if not isinstance(body, bytes):
        body = _body_bytes(body)
    if not isinstance(properties, abc.Mapping):
        return Delivery(queue, routing_key, body, {}, redelivered=redelivered, received=received,
                        unreadable=f"message properties are not a table: {type(properties).__name__}")
    unreadable = str(properties.get(UNREADABLE) or "") or _not_utf8(routing_key)
    headers = properties.get("application_headers")
    if not headers:  # the common case: a message straight from a publisher that sets no headers
        return Delivery(queue, routing_key, body, properties, 1, 0, redelivered, unreadable, received)
    try:
        if not isinstance(headers, abc.Mapping):
            raise HeaderError("application_headers", f"must be a table, got {type(headers).__name__}")
        attempt = wire.attempt_of(headers, queue)
        redeliveries = wire.redeliveries_of(headers, redelivered=redelivered)
        routing_key = wire.original_routing_key(headers, routing_key, queue)
    except HeaderError as exc:
        return Delivery(queue, routing_key, body, properties, redelivered=redelivered, received=received,
                        unreadable=unreadable or f"unreadable {exc}")
    return Delivery(queue, routing_key, body, properties, attempt, redeliveries, redelivered, unreadable, received)


def _not_utf8(routing_key: str) -> str:
    """Why ``routing_key`` cannot be used as text ('' if it can)."""
    return "routing key is not valid UTF-8" if isinstance(routing_key, wire.Undecoded) else ""


def _body_bytes(body: Any) -> bytes:
    """A body py-amqp decoded to text, as bytes again (undecodable bytes as they came; lone surrogates
    as py-amqp would send them); anything else is no body."""
    if not isinstance(body, str):
        return b""
    try:
        return body.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:  # a surrogate that no undecodable byte stands for, e.g. '\ud800'
        return body.encode("utf-8", "surrogatepass")
