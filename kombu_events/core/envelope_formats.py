"""The envelopes other ecosystems put on RabbitMQ, read off the wire: one parser per envelope,
each a pure function from a message to (payload, metadata), and the time formats they write.

A parser raises :class:`Malformed` with the reason alone; :mod:`.envelopes` knows which
envelope it was reading and names it in the error the caller sees.
"""
from __future__ import annotations

__all__ = [
    "Malformed", "Meta", "RawMessage", "cloudevents_structured", "cloudevents_binary", "masstransit_envelope",
    "masstransit_raw", "nservicebus", "spring", "CLOUDEVENTS_PREFIXES", "rfc3339", "nservicebus_time",
]

import base64
import json
import re
from datetime import datetime, timedelta, timezone
from typing import Any, Callable, Mapping, NamedTuple

from ..errors import DecodeError
from .codec import text_encoding


class Malformed(ValueError):
    """What is wrong with an envelope, in words (the caller adds which envelope it was)."""


class Meta(NamedTuple):
    """What an envelope says about its event: the fields of ``Envelope`` but its kind."""

    type: str | None
    id: str | None
    source: str | None
    time: datetime | None
    correlation_id: str | None
    types: tuple[str, ...]
    attributes: dict[str, Any]


class RawMessage(NamedTuple):
    """A message as a parser reads it; ``headers`` maps lower-cased names to (name as sent, value)."""

    body: Any
    content_type: str | None
    content_encoding: str | None
    headers: Mapping[str, tuple[str, Any]]
    properties: Mapping[str, Any]
    decode: Callable[[bytes, str | None, str | None], Any]

    def header(self, name: str) -> Any:
        """The value of header ``name`` (lower case), None when absent."""
        entry = self.headers.get(name)
        return None if entry is None else entry[1]


# CloudEvents has no binding for AMQP 0.9.1: SDKs borrow the AMQP 1.0 prefix or the HTTP one.
CLOUDEVENTS_PREFIXES = ("cloudevents_", "cloudevents:", "ce-", "ce_")
_CE_REQUIRED = ("id", "source", "type")
_CE_TAKEN = frozenset(("id", "source", "type", "time", "data", "data_base64"))
_MT_TAKEN = frozenset(("message", "messageType", "messageId", "sourceAddress", "sentTime", "correlationId"))
_MT_RAW_TAKEN = frozenset(("mt-messagetype", "messageid", "correlationid", "mt-source-address"))
_NSB_TAKEN = frozenset(("nservicebus.enclosedmessagetypes", "nservicebus.messageid", "nservicebus.correlationid",
                        "nservicebus.originatingendpoint", "nservicebus.timesent"))


def cloudevents_structured(message: RawMessage) -> tuple[Any, Meta]:
    """CloudEvents in structured mode: the attributes and the data in one JSON object.

    ``data`` is the payload as it stands in the JSON (a JSON value, or the text of a non-JSON
    ``datacontenttype``); ``data_base64`` goes to the caller's decoder as its ``datacontenttype``
    says, JSON when unset.
    """
    event = _json_object(message)
    if "data" in event and event.get("data_base64") is not None:
        raise Malformed("both 'data' and 'data_base64' are present")
    meta = _cloudevents_meta({name: value for name, value in event.items() if value is not None})
    encoded = event.get("data_base64")
    if encoded is None:
        return event.get("data"), meta
    if not isinstance(encoded, str):
        raise Malformed(f"'data_base64' is not a string: {_show(encoded)}")
    try:
        raw = base64.b64decode(encoded, validate=True)
    except ValueError:  # binascii.Error, or a character beyond ASCII
        raise Malformed(f"'data_base64' is not base64: {_show(encoded)}") from None
    content_type = _text(event.get("datacontenttype"), "attribute 'datacontenttype'") or "application/json"
    return message.decode(raw, content_type, None), meta


def cloudevents_binary(message: RawMessage) -> tuple[Any, Meta]:
    """CloudEvents in binary mode: the attributes in prefixed headers, the data is the body."""
    attributes: dict[str, Any] = {}
    for low, (sent_as, value) in message.headers.items():
        prefix = next((p for p in CLOUDEVENTS_PREFIXES if low.startswith(p)), None)
        if prefix is None or value is None:
            continue
        name = low[len(prefix):]
        # compared as JSON: a signalling-NaN Decimal raises on ==
        if name in attributes and _jsonable(attributes[name]) != _jsonable(value):
            raise Malformed(f"attribute {name!r} is given twice, with different values ({sent_as!r})")
        attributes[name] = value
    content_type = message.content_type or _text(attributes.get("datacontenttype"), "attribute 'datacontenttype'")
    meta = _cloudevents_meta(attributes)
    if content_type:
        meta.attributes["datacontenttype"] = content_type
    return message.decode(message.body, content_type, message.content_encoding), meta


def _cloudevents_meta(attributes: Mapping[str, Any]) -> Meta:
    if "specversion" not in attributes:
        raise Malformed("missing required attribute 'specversion'")
    version = _text(attributes["specversion"], "attribute 'specversion'")
    if version != "1.0":
        raise Malformed(f"unsupported specversion {version!r} (only '1.0' is)")
    for name in _CE_REQUIRED:
        if not attributes.get(name):
            raise Malformed(f"missing required attribute {name!r}")
    kind, id_, source = (_text(attributes[name], f"attribute {name!r}") for name in ("type", "id", "source"))
    time = _time(attributes.get("time"), rfc3339, "attribute 'time'", "an RFC 3339 timestamp")
    rest = {name: _jsonable(value) for name, value in attributes.items() if name not in _CE_TAKEN}
    return Meta(kind, id_, source, time, None, (kind,) if kind else (), rest)


def masstransit_envelope(message: RawMessage) -> tuple[Any, Meta]:
    """MassTransit's JSON envelope: ``message`` is the payload, ``messageType`` lists its URNs."""
    envelope = _json_object(message)
    if envelope.get("message") is None:
        raise Malformed("missing 'message'")
    types = envelope.get("messageType")
    if not isinstance(types, list) or not all(isinstance(urn, str) for urn in types):
        raise Malformed(f"'messageType' is not a list of strings: {_show(types)}")
    if not types:
        raise Malformed("'messageType' is empty")
    time = _time(envelope.get("sentTime"), _iso8601, "'sentTime'", "an ISO 8601 time")
    id_, source, correlation = (_text(envelope.get(name), repr(name))
                                for name in ("messageId", "sourceAddress", "correlationId"))
    rest = {name: value for name, value in envelope.items() if value is not None and name not in _MT_TAKEN}
    return envelope["message"], Meta(types[0], id_, source, time, correlation, tuple(types), rest)


def masstransit_raw(message: RawMessage) -> tuple[Any, Meta]:
    """MassTransit's raw JSON: a bare body, the URNs in ``MT-MessageType`` separated by ``;``."""
    types = _split(message, "mt-messagetype", "MT-MessageType")
    id_ = _text(message.header("messageid"), "header 'MessageId'") or _property(message, "message_id")
    correlation = (_text(message.header("correlationid"), "header 'CorrelationId'")
                   or _property(message, "correlation_id"))
    source = _text(message.header("mt-source-address"), "header 'MT-Source-Address'")
    rest = _rest(message, lambda low: (low.startswith("mt-") or low in ("conversationid", "requestid"))
                 and low not in _MT_RAW_TAKEN)
    meta = Meta(types[0], id_, source, _timestamp(message), correlation, types, rest)
    return message.decode(message.body, message.content_type, message.content_encoding), meta


def nservicebus(message: RawMessage) -> tuple[Any, Meta]:
    """NServiceBus's headers on a bare body: ``NServiceBus.EnclosedMessageTypes`` and the rest."""
    types = _split(message, "nservicebus.enclosedmessagetypes", "NServiceBus.EnclosedMessageTypes")
    id_, correlation, source = (_text(message.header(f"nservicebus.{name.lower()}"), f"header 'NServiceBus.{name}'")
                                for name in ("MessageId", "CorrelationId", "OriginatingEndpoint"))
    time = _time(message.header("nservicebus.timesent"), nservicebus_time, "header 'NServiceBus.TimeSent'",
                 "an NServiceBus timestamp (yyyy-MM-dd HH:mm:ss:ffffff Z)")
    rest = _rest(message, lambda low: low.startswith(("nservicebus.", "$.diagnostics")) and low not in _NSB_TAKEN)
    content_type = message.content_type or _text(message.header("nservicebus.contenttype"),
                                              "header 'NServiceBus.ContentType'")
    meta = Meta(types[0], id_, source, time, correlation, types, rest)
    return message.decode(message.body, content_type, message.content_encoding), meta


def spring(message: RawMessage) -> tuple[Any, Meta]:
    """Spring AMQP's JSON converter: a bare body, the Java class name in ``__TypeId__`` (matched, never loaded)."""
    type_id = _text(message.header("__typeid__"), "header '__TypeId__'")
    if not type_id:
        raise Malformed("header '__TypeId__' is empty")
    rest = _rest(message, lambda low: low in ("__contenttypeid__", "__keytypeid__"))
    meta = Meta(type_id, _property(message, "message_id"), None, _timestamp(message),
                _property(message, "correlation_id"), (type_id,), rest)
    return message.decode(message.body, message.content_type, message.content_encoding), meta


# Values off the wire.

def _json_object(message: RawMessage) -> dict[str, Any]:
    body = message.body
    if not isinstance(body, (str, bytes, bytearray)):
        raise Malformed(f"body is not bytes but {type(body).__name__}")
    try:
        if not isinstance(body, str):
            body = bytes(body).decode(_charset(message.content_type, message.content_encoding))
        document = json.loads(body)
    except DecodeError as exc:  # a label outside the closed list of text encodings
        raise Malformed(str(exc)) from None
    except (TypeError, ValueError, LookupError, RecursionError) as exc:  # UnicodeError is a ValueError
        raise Malformed(f"body is not JSON: {type(exc).__name__}: {str(exc)[:200]}") from None
    if not isinstance(document, dict):
        raise Malformed(f"body is not a JSON object but {type(document).__name__}")
    return document


def _charset(content_type: str | None, content_encoding: str | None) -> str:
    """The codec of a JSON envelope's text, from the closed list only (codec.text_encoding raises otherwise)."""
    codec = text_encoding(content_encoding)
    if codec is not None and codec != "binary":
        return codec
    found = re.search(r';\s*charset\s*=\s*"?([^";\s]+)', content_type or "", re.IGNORECASE)
    charset = text_encoding(found.group(1)) if found else None
    return "utf-8" if charset is None or charset == "binary" else charset


def _text(value: Any, what: str) -> str | None:
    """A string attribute: header values may arrive as bytes, and an integer id is read as its digits."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, (bytes, bytearray)):
        try:
            return bytes(value).decode("utf-8")
        except UnicodeDecodeError:
            raise Malformed(f"{what} is not UTF-8 text: {_show(value)}") from None
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    raise Malformed(f"{what} is not a string: {_show(value)}")


def _property(message: RawMessage, name: str) -> str | None:
    value = message.properties.get(name)  # a basic property: not the envelope's to be wrong about
    return value if isinstance(value, str) and value else None


def _split(message: RawMessage, low: str, name: str) -> tuple[str, ...]:
    types = tuple(part.strip() for part in (_text(message.header(low), f"header {name!r}") or "").split(";"))
    types = tuple(part for part in types if part)
    if not types:
        raise Malformed(f"header {name!r} names no message type")
    return types


def _rest(message: RawMessage, wanted: Callable[[str], bool]) -> dict[str, Any]:
    return {sent_as: _jsonable(value) for low, (sent_as, value) in message.headers.items() if wanted(low)}


def _jsonable(value: Any) -> Any:
    if value is None or isinstance(value, (str, bool, int, float)):
        return value
    if isinstance(value, (bytes, bytearray)):
        return bytes(value).decode("utf-8", "replace")
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, Mapping):
        return {str(key): _jsonable(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(item) for item in value]
    return str(value)  # a Decimal, or whatever else an AMQP table holds


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


# Times.

def _time(value: Any, parse: Callable[[str], datetime], what: str, expected: str) -> datetime | None:
    if value is None:
        return None
    if isinstance(value, datetime):  # an AMQP timestamp in a header: py-amqp gives naive UTC
        return value if value.tzinfo else value.replace(tzinfo=timezone.utc)
    text = _text(value, what)
    try:
        return parse(text or "")
    except ValueError:
        raise Malformed(f"{what} is not {expected}: {_show(value)}") from None


def _timestamp(message: RawMessage) -> datetime | None:
    """The AMQP ``timestamp`` property (seconds), if the publisher set a sane one."""
    seconds = message.properties.get("timestamp")
    if isinstance(seconds, datetime):
        return seconds if seconds.tzinfo else seconds.replace(tzinfo=timezone.utc)
    if not isinstance(seconds, int) or isinstance(seconds, bool):
        return None
    try:
        return datetime.fromtimestamp(seconds, timezone.utc)
    except (OverflowError, OSError, ValueError):
        return None


# [0-9], not \d: \d matches every Unicode digit, and int() would read them.
_RFC3339 = re.compile(r"([0-9]{4})-([0-9]{2})-([0-9]{2})[Tt ]([0-9]{2}):([0-9]{2}):([0-9]{2})(?:\.([0-9]+))?"
                      r"([Zz]|[+-][0-9]{2}:[0-9]{2})?")
_NSB = re.compile(r"([0-9]{4})-([0-9]{2})-([0-9]{2}) ([0-9]{2}):([0-9]{2}):([0-9]{2}):([0-9]{6}) Z")


def rfc3339(text: str) -> datetime:
    """An RFC 3339 timestamp (offset required), any number of fractional digits; ValueError otherwise.

    ``datetime.fromisoformat`` before Python 3.11 takes neither ``Z`` nor more than six digits
    (.NET writes seven): digits past the microsecond are dropped.
    """
    return _iso(text, offset_required=True)


def _iso8601(text: str) -> datetime:
    # MassTransit writes UTC; a DateTime of unspecified kind comes without an offset.
    return _iso(text, offset_required=False)


def _iso(text: str, *, offset_required: bool) -> datetime:
    found = _RFC3339.fullmatch(text)
    if found is None or (offset_required and found.group(8) is None):
        raise ValueError(f"not an RFC 3339 timestamp: {text!r}")
    year, month, day, hour, minute, second = (int(part) for part in found.groups()[:6])
    micro = int((found.group(7) or "0")[:6].ljust(6, "0"))
    return datetime(year, month, day, hour, minute, second, micro, tzinfo=_offset(found.group(8)))


def _offset(text: str | None) -> timezone:
    if text is None or text in ("Z", "z"):
        return timezone.utc
    sign = -1 if text[0] == "-" else 1
    return timezone(sign * timedelta(hours=int(text[1:3]), minutes=int(text[4:6])))  # ValueError past 24 h


def nservicebus_time(text: str) -> datetime:
    """NServiceBus's wire format, ``yyyy-MM-dd HH:mm:ss:ffffff Z`` in UTC (not ISO 8601); ValueError otherwise."""
    found = _NSB.fullmatch(text)
    if found is None:
        raise ValueError(f"not an NServiceBus timestamp: {text!r}")
    year, month, day, hour, minute, second, micro = (int(part) for part in found.groups())
    return datetime(year, month, day, hour, minute, second, micro, tzinfo=timezone.utc)
