"""Properties of every pure function that reads message data: whatever a publisher sends, none of them breaks.

The readers return a value of the right type or raise DecodeError; read_delivery,
classify and plan never raise; decode raises DecodeError and nothing else; a copy
of a message the wire guard decoded can always be sent again.
"""
from __future__ import annotations

import json
import pickle
from datetime import datetime
from decimal import Decimal
from typing import Any, Callable

import amqp
import amqp.serialization
import pytest
from hypothesis import example, given, settings, strategies as st

from kombu_events.broker.lenient_amqp import decode_properties_leniently
from kombu_events.core import wire
from kombu_events.core.backoff import Exponential
from kombu_events.core.codec import JSON, decode
from kombu_events.core.config import resolve_settings
from kombu_events.core.decision import (
    ARCHIVE,
    DEFERRED,
    FAILED,
    LOST,
    OK,
    REDELIVERED,
    RETRY,
    UNDECODABLE,
    Outcome,
    classify,
)
from kombu_events.core.delivery import UNREADABLE, Delivery, read_delivery
from kombu_events.core.handlers import Handler
from kombu_events.core.settlement import Hold, Republish, plan
from kombu_events.core.topology import build_topology
from kombu_events.errors import Archive, DecodeError, Poisoned, Retry

PROPS = settings(max_examples=200, deadline=None)
STRING_PROPERTY_NAMES = ("content_type", "content_encoding", "correlation_id", "reply_to", "expiration", "message_id",
                         "type", "user_id", "app_id", "cluster_id")
QUEUE = "billing.audit"
PICKLE = "application/x-python-serialize"
BACKOFF = Exponential(base_ms=100, factor=2, max_delay_ms=25_500, jitter=0.5)
TOPOLOGY = build_topology(resolve_settings("billing", environ={}, delay_unit_ms=100, delay_levels=8), [
    Handler(fn=lambda payload: None, name="audit", queue=QUEUE, binding_keys=("orders.#",), max_retries=3,
            backoff=BACKOFF),
])

# -- AMQP field values ---------------------------------------------------------------------------

#: Text as py-amqp can hand it over: any code point, lone surrogates included.
ANY_TEXT = st.text(st.characters(exclude_categories=()), max_size=20)
#: Text the wire guard decoded from bytes that are not UTF-8 (surrogate escapes).
ESCAPED_TEXT = st.binary(max_size=20).map(wire.Undecoded.of)
#: Text as it reaches the planner: py-amqp's (lone surrogates included) or the guard's.
WIRE_TEXT = st.one_of(ANY_TEXT, ESCAPED_TEXT)
TEXT = st.one_of(ANY_TEXT, ESCAPED_TEXT)

SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(), st.floats(), TEXT, st.binary(max_size=20), st.decimals(),
    st.datetimes(),
)


def _fields(scalars: st.SearchStrategy[Any], keys: st.SearchStrategy[str]) -> st.SearchStrategy[Any]:
    """Field values nested several levels deep: arrays and tables of ``scalars``."""
    return st.recursive(
        scalars,
        lambda children: st.lists(children, max_size=4) | st.dictionaries(keys, children, max_size=4),
        max_leaves=25,
    )


FIELDS = _fields(SCALARS, TEXT)
COUNTER = st.one_of(st.integers(0, 10), st.integers(), FIELDS)
#: ``x-death`` entries: mostly as the broker writes them, some with any field malformed, some not tables.
DEATH = st.one_of(
    st.fixed_dictionaries({
        "queue": st.sampled_from([QUEUE, "billing.delay.0"]),
        "reason": st.sampled_from(["rejected", "expired"]),
        "routing-keys": st.lists(TEXT, max_size=2),
    }, optional={"count": st.integers(0, 10)}),
    st.fixed_dictionaries({}, optional={
        "queue": st.one_of(st.sampled_from([QUEUE, "billing.delay.0"]), FIELDS),
        "reason": st.one_of(st.sampled_from(["rejected", "expired"]), FIELDS),
        "count": COUNTER,
        "routing-keys": st.one_of(st.lists(TEXT, max_size=3), FIELDS),
        "exchange": FIELDS,
    }),
    FIELDS,
)


def _headers(routing_key: st.SearchStrategy[Any]) -> st.SearchStrategy[dict[Any, Any]]:
    """A header table: the publisher's own headers beside ours and the broker's, any of them malformed."""
    ours = st.fixed_dictionaries({}, optional={
        wire.ATTEMPTS: COUNTER,
        wire.REDELIVERIES: COUNTER,
        wire.ROUTING_KEY: routing_key,
        wire.FIRST_FAILURE_AT: FIELDS,
        "x-death": st.one_of(st.lists(DEATH, max_size=3), FIELDS),
        "x-first-death-queue": FIELDS,
    })
    theirs = st.dictionaries(st.one_of(TEXT, st.binary(max_size=5)), FIELDS, max_size=3)
    return st.builds(lambda a, b: {**b, **a}, ours, theirs)


HEADERS = _headers(st.one_of(TEXT, FIELDS))
MAYBE_HEADERS = st.one_of(st.none(), HEADERS)


def _value_or_decode_error(call: Callable[[], Any], kind: type) -> Any:
    """``call()``'s value, checked to be a ``kind`` (a bool is no int); None if it raised DecodeError."""
    try:
        value = call()
    except DecodeError:
        return None
    assert isinstance(value, kind) and not isinstance(value, bool), f"{value!r} is not a {kind.__name__}"
    return value


# -- the header readers ----------------------------------------------------------------------------

@PROPS
@given(MAYBE_HEADERS)
def test_attempt_of_is_a_positive_int_or_a_decode_error(headers):
    attempt = _value_or_decode_error(lambda: wire.attempt_of(headers, QUEUE), int)
    assert attempt is None or attempt >= 1


@PROPS
@given(MAYBE_HEADERS)
def test_redeliveries_of_is_a_count_or_a_decode_error(headers):
    count = _value_or_decode_error(lambda: wire.redeliveries_of(headers), int)
    assert count is None or count >= 0


@PROPS
@given(MAYBE_HEADERS, TEXT)
def test_original_routing_key_is_text_or_a_decode_error(headers, routing_key):
    _value_or_decode_error(lambda: wire.original_routing_key(headers, routing_key, QUEUE), str)


@PROPS
@given(HEADERS)
def test_rejected_count_is_a_count_or_a_decode_error(headers):
    count = _value_or_decode_error(lambda: wire.rejected_count(headers, QUEUE), int)
    assert count is None or count >= 0


# -- read_delivery ---------------------------------------------------------------------------------

PROPERTIES = st.fixed_dictionaries({}, optional={
    "application_headers": st.one_of(HEADERS, FIELDS),
    "content_type": st.one_of(TEXT, FIELDS),
    "message_id": st.one_of(TEXT, FIELDS),
    "expiration": st.one_of(TEXT, FIELDS),
    UNREADABLE: FIELDS,
})
DELIVERY_INFO = st.fixed_dictionaries({}, optional={"routing_key": st.one_of(TEXT, FIELDS),
                                                    "redelivered": FIELDS})


@PROPS
@given(st.one_of(st.binary(), TEXT, st.none(), FIELDS), st.one_of(PROPERTIES, FIELDS), DELIVERY_INFO)
def test_read_delivery_never_raises(body, properties, delivery_info):
    delivery = read_delivery(QUEUE, body, properties, delivery_info)
    assert isinstance(delivery, Delivery)
    assert type(delivery.body) is bytes and isinstance(delivery.routing_key, str)
    assert type(delivery.unreadable) is str
    assert type(delivery.attempt) is int and delivery.attempt >= 1
    assert type(delivery.redeliveries) is int and delivery.redeliveries >= 0


# -- codec.decode ----------------------------------------------------------------------------------

CONTENT_TYPES = st.one_of(st.sampled_from([
    JSON, PICKLE, "application/json; charset=utf-8", " Application/JSON ", ";", "text/plain", "application/x-yaml",
    "application/data", "application/text", "application/x-msgpack",
]), st.none(), TEXT)
ENCODINGS = st.one_of(st.sampled_from([
    "utf-8", "UTF8", "binary", "latin-1", "utf-16", "ascii", "rot13", "zlib", "base64", "hex", "idna", "\udcff",
]), st.none(), TEXT)
ACCEPTS = st.sampled_from([frozenset({JSON}), frozenset({JSON, PICKLE}), frozenset({PICKLE})])
JSON_VALUES = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | TEXT,
                           lambda c: st.lists(c, max_size=3) | st.dictionaries(TEXT, c, max_size=3), max_leaves=10)
BODIES = st.one_of(
    JSON_VALUES.map(lambda value: json.dumps(value).encode()),
    JSON_VALUES.map(lambda value: json.dumps(value, ensure_ascii=False)),  # a str body
    st.recursive(st.none() | st.integers() | st.text(), lambda c: st.lists(c, max_size=3)).map(pickle.dumps),
    st.binary(),
    TEXT,
    st.sampled_from([b"[" * 5000, b'{"a":' * 5000, b"1" * 5000, b"1e99999", b"NaN", b'"\\ud800"', b"\x80\x04N."]),
)


@PROPS
@given(BODIES, CONTENT_TYPES, ENCODINGS, ACCEPTS)
def test_decode_returns_a_value_or_raises_decode_error(body, content_type, content_encoding, accept):
    try:
        decode(body, content_type, content_encoding, accept)
    except DecodeError:
        pass


@pytest.mark.parametrize("content_type", [JSON, None])
@pytest.mark.parametrize("body", [b"[" * 100_000 + b"]" * 100_000, "[" * 100_000 + "]" * 100_000,
                                  b'{"a":' * 100_000 + b"1" + b"}" * 100_000])
def test_json_nested_too_deep_is_a_decode_error(body, content_type):
    with pytest.raises(DecodeError, match="RecursionError"):
        decode(body, content_type, None, frozenset({JSON}))


# -- decision.classify -----------------------------------------------------------------------------

STR_ERRORS = st.sampled_from([ValueError("no str"), RecursionError(), TypeError(), UnicodeEncodeError(
    "utf-8", "\ud800", 0, 1, "surrogates not allowed"), KeyError("k"), None])


class _Unprintable:
    """An object whose str() and repr() raise (``error``), or return something that is not text (None)."""

    def __init__(self, error: BaseException | None) -> None:
        self.error = error

    def _fail(self) -> Any:
        if self.error is None:
            return 42  # str() then raises TypeError
        raise self.error

    __str__ = __repr__ = _fail


def _unprintable(base: type[BaseException], error: BaseException | None) -> BaseException:
    cls = type(f"Unprintable{base.__name__}", (base,), {"__str__": lambda self: _Unprintable(error)._fail(),
                                                        "__repr__": lambda self: _Unprintable(error)._fail()})
    exc = cls.__new__(cls)
    exc.args = (_Unprintable(error),)
    if issubclass(base, (Archive, Retry)):
        exc.reason = _Unprintable(error)
        exc.delay = None
    return exc


def _raised(exc: BaseException) -> BaseException:
    try:
        raise exc
    except BaseException as caught:
        return caught


EXCEPTIONS = st.builds(
    _unprintable, st.sampled_from([Exception, ValueError, KeyError, OSError, Retry, Archive, Poisoned]), STR_ERRORS,
)
CLASSES = st.lists(st.sampled_from([Exception, ValueError, KeyError, OSError, LookupError, Retry, Archive]),
                   max_size=3).map(tuple)


@PROPS
@given(EXCEPTIONS, st.booleans(), CLASSES.filter(bool), CLASSES, st.integers(0, 60_000), st.booleans())
def test_classify_never_raises_even_when_str_does(exc, raise_it, retry_for, dont_retry, traceback_limit, final):
    exc = _raised(exc) if raise_it else exc
    outcome = classify(exc, retry_for=retry_for, dont_retry=dont_retry, traceback_limit=traceback_limit,
                       final=final)
    assert outcome.kind in (FAILED, RETRY, ARCHIVE)
    assert all(type(text) is str for text in (outcome.reason, outcome.exception, outcome.traceback))
    assert len(outcome.traceback) <= traceback_limit
    assert "<unprintable>" in outcome.exception


# -- plan ------------------------------------------------------------------------------------------

OUTCOMES = st.builds(
    Outcome,
    kind=st.sampled_from([OK, FAILED, RETRY, ARCHIVE, UNDECODABLE, LOST, REDELIVERED, DEFERRED, "unheard-of"]),
    reason=TEXT, exception=TEXT, traceback=TEXT,
    delay_ms=st.one_of(st.none(), st.floats(), st.integers(-10**6, 10**300)),
)


def _wire_properties(text: st.SearchStrategy[str]) -> st.SearchStrategy[dict[str, Any]]:
    """Basic properties as py-amqp delivers them, header table aside."""
    return st.fixed_dictionaries({}, optional={
        **dict.fromkeys(STRING_PROPERTY_NAMES, text),
        "delivery_mode": st.integers(0, 255), "priority": st.integers(0, 255), "timestamp": st.integers(0, 2**64 - 1),
    })


def _plan_everything(properties: dict[str, Any], headers: Any, routing_key: str, redelivered: bool,
                     outcome: Outcome, userid: str | None, r: float) -> None:
    """Plan a delivery and every fallback after it; each step is an Ack, Hold or Republish."""
    delivery = read_delivery(QUEUE, b"{}", {**properties, "application_headers": headers},
                             {"routing_key": routing_key, "redelivered": redelivered})
    step = plan(delivery, outcome, max_retries=3, backoff=BACKOFF, topology=TOPOLOGY, userid=userid,
                rand=lambda: r)
    for _ in range(4):
        if not isinstance(step, Republish):
            break
        assert step.action in ("retry", "requeue", "archive")
        assert isinstance(step.properties["application_headers"], dict)
        step = step.if_refused("nacked")
    assert step.action in ("ack", "held") and (step.action == "ack") != isinstance(step, Hold)


#: Header values for plan: any field, the application headers themselves included.
PLANNABLE_FIELDS = FIELDS


@PROPS
@given(_wire_properties(WIRE_TEXT), st.one_of(_headers(st.one_of(WIRE_TEXT, FIELDS)), PLANNABLE_FIELDS), WIRE_TEXT,
       st.booleans(), OUTCOMES, st.sampled_from([None, "guest", "billing-svc"]), st.floats(0, 1))
def test_plan_never_raises_and_always_ends(properties, headers, routing_key, redelivered, outcome, userid, r):
    _plan_everything(properties, headers, routing_key, redelivered, outcome, userid, r)


SURROGATE = "orders.\ud800"  # how py-amqp decodes b"orders.\xed\xa0\x80" (surrogatepass)


@PROPS
@example({"message_id": SURROGATE}, {}, "orders.1", False, Outcome(ARCHIVE), None, 0.5)
@given(_wire_properties(ANY_TEXT), st.one_of(HEADERS, PLANNABLE_FIELDS), ANY_TEXT, st.booleans(), OUTCOMES,
       st.sampled_from([None, "guest"]), st.floats(0, 1))
def test_plan_never_raises_on_any_text(properties, headers, routing_key, redelivered, outcome, userid, r):
    _plan_everything(properties, headers, routing_key, redelivered, outcome, userid, r)


@pytest.mark.parametrize("kind", [RETRY, DEFERRED])
def test_plan_with_a_delay_too_large_for_a_float(kind):
    delivery = read_delivery(QUEUE, b"{}", {}, {"routing_key": "orders.1"})
    step = plan(delivery, Outcome(kind, delay_ms=10**309), max_retries=3, backoff=BACKOFF, topology=TOPOLOGY)
    assert step.action == "archive"


# -- republish_properties: what the guard decoded can be sent again ----------------------------------

SHORT_TEXT = st.text(st.characters(exclude_categories=()), max_size=60)  # <= 240 bytes: a shortstr
SHORTSTR = st.one_of(SHORT_TEXT, st.binary(max_size=255))  # py-amqp writes bytes as they are
SENDABLE_SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(-2**63, 2**63 - 1), st.floats(), SHORT_TEXT, st.binary(max_size=40),
    st.builds(lambda digits, places: Decimal(digits).scaleb(-places), st.integers(-2**31 + 1, 2**31 - 1),
              st.integers(0, 20)),
    st.datetimes(min_value=datetime(1970, 1, 1), max_value=datetime(9999, 12, 31)).map(
        lambda moment: moment.replace(microsecond=0)),
)
SENDABLE_HEADERS = st.dictionaries(SHORT_TEXT, _fields(SENDABLE_SCALARS, SHORT_TEXT), max_size=5)
SENDABLE_PROPERTIES = st.fixed_dictionaries({}, optional={
    **dict.fromkeys(STRING_PROPERTY_NAMES, SHORTSTR),
    "application_headers": SENDABLE_HEADERS,
    "delivery_mode": st.integers(0, 255), "priority": st.integers(0, 255), "timestamp": st.integers(0, 2**64 - 1),
})
STRING_PROPERTIES = ("content_type", "content_encoding", "correlation_id", "reply_to", "message_id", "type",
                     "user_id", "app_id", "cluster_id")


def _frame(properties: dict[str, Any]) -> bytes:
    return amqp.Message(b"", **properties)._serialize_properties()


def _bytes(value: Any) -> Any:
    """What a property value is on the wire (py-amqp encodes text with surrogatepass)."""
    return value.encode("utf-8", "surrogatepass") if isinstance(value, str) else value


def _table(headers: dict[str, Any]) -> bytes:
    return amqp.serialization.dumps("F", [headers])


def _assert_sent_as_received(sent: dict[str, Any], received: dict[str, Any], userid: str | None) -> None:
    copy = wire.republish_properties(received, dict(received.get("application_headers") or {}), userid=userid)
    again, _ = decode_properties_leniently(_frame(copy), 0)  # encodable, or this raises
    expected_user_id = None if sent.get("user_id") is None or userid is None else userid  # the connection's own
    for name in STRING_PROPERTIES:
        expected = expected_user_id if name == "user_id" else sent.get(name)
        assert _bytes(wire.as_sent(again.get(name))) == _bytes(expected), name
    for name in ("delivery_mode", "priority", "timestamp"):
        assert again.get(name) == sent.get(name)
    assert "expiration" not in again
    headers = dict(received.get("application_headers") or {})  # py-amqp's decimals come back normalised
    if sent.get("expiration") is not None:
        headers[wire.EXPIRATION] = sent["expiration"]
    assert _table(again["application_headers"]) == _table(headers)


@PROPS
@given(SENDABLE_PROPERTIES, st.booleans())
def test_a_copy_of_what_the_guard_decoded_is_sent_with_the_same_bytes(properties, same_user):
    received, end = decode_properties_leniently(_frame(properties), 0)
    assert end == len(_frame(properties))
    userid = received.get("user_id") if same_user else "guest"
    _assert_sent_as_received(properties, received, userid)


@PROPS
@example({"message_id": SURROGATE}, True)
@given(SENDABLE_PROPERTIES, st.booleans())
def test_a_copy_of_what_the_installed_decoder_decoded_is_sent_with_the_same_bytes(properties, same_user):
    frame = _frame(properties)
    try:  # what wire_guard.install() puts in py-amqp: the strict decoder first
        received, _ = amqp.serialization.decode_properties_basic(frame, 0)
    except Exception:
        received, _ = decode_properties_leniently(frame, 0)
    userid = received.get("user_id") if same_user else "guest"
    _assert_sent_as_received(properties, received, userid)


# -- what the planner writes, read_delivery reads back -----------------------------------------------

@PROPS
@given(HEADERS, WIRE_TEXT, OUTCOMES, st.floats(0, 1))
def test_a_retried_or_requeued_copy_reads_back_as_the_next_delivery(headers, routing_key, outcome, r):
    delivery = read_delivery(QUEUE, b"{}", {"application_headers": headers}, {"routing_key": routing_key})
    step = plan(delivery, outcome, max_retries=3, backoff=BACKOFF, topology=TOPOLOGY, rand=lambda: r)
    if delivery.unreadable or step.action not in ("retry", "requeue"):
        return
    back = read_delivery(QUEUE, b"{}", step.properties, {"routing_key": step.routing_key})
    assert back.unreadable == ""
    assert back.routing_key == delivery.routing_key
    assert back.attempt == delivery.attempt + (step.action == "retry")
    assert back.redeliveries == delivery.redeliveries + (outcome.kind == REDELIVERED)
