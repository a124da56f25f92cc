"""Envelopes from other ecosystems (CloudEvents, MassTransit, NServiceBus, Spring AMQP): recognised
by content type or headers, unwrapped into the payload and an :class:`Envelope` describing it.

Which parser reads a message is decided by two tables: the content type names a structured
envelope (the whole body is the envelope); otherwise a header names one that rides on a bare
body. A message that matches neither is bare, and costs one pass over its header names.
"""
from __future__ import annotations

__all__ = ["Envelope", "EnvelopeError", "unwrap"]

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Callable, Mapping, NamedTuple

from ..errors import DecodeError
from . import envelope_formats as formats

# The kinds of envelope, and the name each goes by in messages.
_LABELS = {"cloudevents": "CloudEvents", "masstransit": "MassTransit", "nservicebus": "NServiceBus",
           "spring": "Spring AMQP"}

_OWN_HEADERS = "kombu-events-"
_MASSTRANSIT_URN = "urn:message:"


@dataclass(frozen=True)
class Envelope:
    """What the envelope said about the event (``event.envelope`` of a bound handler).

    ``kind`` is ``"cloudevents"``, ``"masstransit"``, ``"nservicebus"`` or ``"spring"``;
    ``type`` the primary message type as sent, ``types`` every one it carries (MassTransit
    lists the base types and interfaces too). ``source`` is CloudEvents' ``source``,
    MassTransit's ``sourceAddress``, NServiceBus's ``OriginatingEndpoint`` (None for
    Spring); ``time`` is timezone-aware (UTC where the format says so). ``attributes``
    holds the rest (CloudEvents extensions, ``conversationId``, ...), as JSON values.
    """

    kind: str
    type: str | None
    id: str | None
    source: str | None
    time: datetime | None
    correlation_id: str | None
    types: tuple[str, ...] = ()
    attributes: Mapping[str, Any] = field(default_factory=dict)

    def matches(self, wanted: str) -> bool:
        """Whether the message is of type ``wanted``: one of ``types``, exactly, or a short form of one.

        Short forms, so one name can serve both .NET buses: a MassTransit URN
        ``urn:message:Company.Contracts:OrderPlaced`` also matches ``Company.Contracts:OrderPlaced``
        and the .NET full name ``Company.Contracts.OrderPlaced``; an NServiceBus assembly-qualified
        name ``Company.Contracts.OrderPlaced, Contracts, Version=...`` also matches its full name
        ``Company.Contracts.OrderPlaced``. Nothing else: names are compared case-sensitively, and a
        Java class name is matched, never loaded.
        """
        return wanted in self.types or any(wanted in _short_forms(self.kind, name) for name in self.types)


def _short_forms(kind: str, name: str) -> tuple[str, ...]:
    if kind == "masstransit" and name.startswith(_MASSTRANSIT_URN):
        namespaced = name[len(_MASSTRANSIT_URN):]
        namespace, _, type_name = namespaced.rpartition(":")
        return (namespaced, f"{namespace}.{type_name}") if namespace else (namespaced,)
    if kind == "nservicebus":
        return (_full_name(name),)
    return ()


def _full_name(assembly_qualified: str) -> str:
    """The type's full name: up to the first comma outside the brackets of generic arguments."""
    depth = 0
    for at, char in enumerate(assembly_qualified):
        depth += {"[": 1, "]": -1}.get(char, 0)
        if char == "," and depth == 0:
            return assembly_qualified[:at].strip()
    return assembly_qualified.strip()


class EnvelopeError(DecodeError):
    """A message is in an envelope it does not fill in properly; the message names the envelope, how
    it was sent (``mode``) and what is wrong (``reason``)."""

    def __init__(self, kind: str, mode: str, reason: str) -> None:
        super().__init__(f"malformed {_LABELS.get(kind, kind)} envelope ({mode}): {reason}")
        self.kind = kind
        self.mode = mode
        self.reason = reason


Parser = Callable[[formats.RawMessage], tuple[Any, formats.Meta]]


class _Reader(NamedTuple):
    kind: str
    mode: str
    parse: Parser
    rank: int  # among header-borne envelopes, the lower wins when a message carries several


_BY_CONTENT_TYPE = {
    "application/cloudevents+json": _Reader("cloudevents", "structured", formats.cloudevents_structured, 0),
    "application/vnd.masstransit+json": _Reader("masstransit", "envelope", formats.masstransit_envelope, 0),
}
_CLOUDEVENTS_BINARY = _Reader("cloudevents", "binary", formats.cloudevents_binary, 0)
_BY_HEADER = {  # lower-cased header name -> reader
    "mt-messagetype": _Reader("masstransit", "raw", formats.masstransit_raw, 1),
    "nservicebus.enclosedmessagetypes": _Reader("nservicebus", "headers", formats.nservicebus, 2),
    "__typeid__": _Reader("spring", "headers", formats.spring, 3),
}


def unwrap(body: bytes, content_type: str | None, content_encoding: str | None,
           headers: Mapping[str, Any] | None, properties: Mapping[str, Any],
           decode: Callable[[bytes, str | None, str | None], Any]) -> tuple[Any, Envelope | None]:
    """The payload (decoded) and the envelope it came in; ``(decode(body, content_type, content_encoding), None)``
    for a bare message.

    ``decode`` is the caller's decoder for a body of a content type (its accept list applies
    to the data an envelope carries too). Raises :class:`EnvelopeError` for a malformed
    envelope and lets ``decode``'s own ``DecodeError`` through; nothing else, whatever the input.
    """
    if not isinstance(content_type, str):
        content_type = None
    reader = _BY_CONTENT_TYPE.get(_media_type(content_type)) if content_type else None
    if reader is None and headers:
        reader = _recognise(headers)
    if reader is None:
        return decode(body, content_type, content_encoding), None
    message = formats.RawMessage(body, content_type, content_encoding if isinstance(content_encoding, str) else None,
                                 _by_name(headers or {}), properties if isinstance(properties, Mapping) else {}, decode)
    try:
        payload, meta = reader.parse(message)
    except formats.Malformed as exc:
        raise EnvelopeError(reader.kind, reader.mode, str(exc)) from None
    return payload, Envelope(reader.kind, **meta._asdict())


def _media_type(content_type: str | None) -> str:
    return (content_type or "").split(";", 1)[0].strip().lower()


def _recognise(headers: Mapping[str, Any]) -> _Reader | None:
    """The reader for the envelope the headers name, in one pass over their names (None: bare).

    CloudEvents' binary mode is recognised by one of its required attributes under one of the prefixes.

    Our own ``kombu-events-`` headers need no skipping here: none of them looks like an envelope's.
    """
    found: _Reader | None = None
    for key in headers:
        name = key.lower() if isinstance(key, str) else _lower(key)
        if name is None:
            continue
        if name.startswith(formats.CLOUDEVENTS_PREFIXES) and _cloudevents_attribute(name) in _CE_NAMING:
            return _CLOUDEVENTS_BINARY  # a stray ``ce-foo`` header alone does not make a message a CloudEvent
        reader = _BY_HEADER.get(name)
        if reader is not None and (found is None or reader.rank < found.rank):
            found = reader
    return found


#: The required attributes of a CloudEvent: one of them under a prefix makes the message a binary-mode CloudEvent.
_CE_NAMING = frozenset(("specversion", "id", "source", "type"))


def _cloudevents_attribute(name: str) -> str:
    """``id`` of ``ce-id``: the header name without its CloudEvents prefix."""
    for prefix in formats.CLOUDEVENTS_PREFIXES:
        if name.startswith(prefix):
            return name[len(prefix):]
    return name


def _by_name(headers: Mapping[str, Any]) -> dict[str, tuple[str, Any]]:
    named = ((_lower(key), key, value) for key, value in headers.items())
    return {low: (key if isinstance(key, str) else low, value)
            for low, key, value in named if low is not None and not low.startswith(_OWN_HEADERS)}


def _lower(key: Any) -> str | None:
    # AMQP header names are case-sensitive, but publishers of the same envelope disagree on case.
    if isinstance(key, str):
        return key.lower()
    if isinstance(key, (bytes, bytearray)):
        return bytes(key).decode("utf-8", "replace").lower()
    return None
