"""core/delivery.py: read_delivery turns whatever arrived into a Delivery, naming what it could not read."""
from __future__ import annotations

import pytest

from kombu_events.core import wire
from kombu_events.core.codec import JSON
from kombu_events.core.delivery import UNREADABLE, Delivery, read_delivery

QUEUE = "billing.audit"
EVENT_KEY = "orders.7.created"
LADDER_KEY = "0.0.0.0.0.0.0.1.billing.audit"
BODY = b'{"order_id": 7}'


def _read(properties, routing_key=EVENT_KEY, redelivered=False, body=BODY, **kwargs) -> Delivery:
    return read_delivery(QUEUE, body, properties, {"routing_key": routing_key, "redelivered": redelivered},
                         **kwargs)


def _death(queue=QUEUE, reason="rejected", count=1, keys=(EVENT_KEY,)):
    return {"queue": queue, "reason": reason, "count": count, "exchange": "events", "routing-keys": list(keys)}


def test_a_plain_delivery():
    properties = {"content_type": JSON, "content_encoding": "utf-8", "message_id": "m-1",
                  "application_headers": {"x-request-id": "r-1"}}
    delivery = _read(properties, received=12.5)
    assert delivery == Delivery(QUEUE, EVENT_KEY, BODY, properties, attempt=1, redeliveries=0, redelivered=False,
                                unreadable="", received=12.5)
    assert (delivery.headers, delivery.message_id, delivery.content_type, delivery.content_encoding) == (
        {"x-request-id": "r-1"}, "m-1", JSON, "utf-8")


def test_a_delivery_without_properties_or_headers():
    delivery = _read({})
    assert (delivery.attempt, delivery.routing_key, delivery.unreadable) == (1, EVENT_KEY, "")
    assert delivery.headers == {}
    assert (delivery.message_id, delivery.content_type, delivery.content_encoding) == (None, None, None)


@pytest.mark.parametrize("headers", [None, {}])
def test_no_headers_is_the_first_attempt(headers):
    delivery = _read({"application_headers": headers})
    assert (delivery.attempt, delivery.redeliveries, delivery.routing_key, delivery.unreadable) == (
        1, 0, EVENT_KEY, "")
    assert delivery.headers == {}


def test_back_from_the_ladder_the_routing_key_header_wins():
    headers = {
        wire.ATTEMPTS: 2,
        wire.ROUTING_KEY: "orders.9.created",
        "x-death": [_death(count=3, keys=("orders.other",)),
                    _death(queue="billing.delay.0", reason="expired", count=1, keys=(LADDER_KEY,))],
    }
    delivery = _read({"application_headers": headers}, routing_key=LADDER_KEY)
    assert (delivery.attempt, delivery.routing_key, delivery.unreadable) == (6, "orders.9.created", "")


def test_back_from_a_reject_the_routing_key_comes_from_x_death():
    headers = {"x-death": [_death(queue="billing.delay.0", reason="expired", keys=(LADDER_KEY,)),
                           _death(count=1, keys=(EVENT_KEY, "cc.key"))]}
    delivery = _read({"application_headers": headers}, routing_key=LADDER_KEY)
    assert (delivery.attempt, delivery.routing_key) == (2, EVENT_KEY)


def test_rejects_out_of_other_queues_are_not_counted():
    headers = {"x-death": [_death(queue="shipping.on_order", count=5)]}
    assert _read({"application_headers": headers}).attempt == 1


@pytest.mark.parametrize("redelivered", [True, 1, "yes"])
def test_redelivered_flag(redelivered):
    delivery = _read({"application_headers": {wire.REDELIVERIES: 2}}, redelivered=redelivered)
    assert (delivery.redelivered, delivery.redeliveries) == (True, 2)


@pytest.mark.parametrize("info", [{}, {"routing_key": None}, {"routing_key": b"orders"}, {"redelivered": None}])
def test_delivery_info_without_usable_values(info):
    delivery = read_delivery(QUEUE, BODY, {}, info)
    assert (delivery.routing_key, delivery.redelivered, delivery.unreadable) == (
        info.get("routing_key") if isinstance(info.get("routing_key"), str) else "", False, "")


@pytest.mark.parametrize(
    "headers, named",
    [
        ({wire.ATTEMPTS: "3"}, wire.ATTEMPTS),
        ({wire.ATTEMPTS: -1}, wire.ATTEMPTS),
        ({wire.ATTEMPTS: 2.0}, wire.ATTEMPTS),
        ({wire.ATTEMPTS: True}, wire.ATTEMPTS),
        ({wire.ATTEMPTS: [1]}, wire.ATTEMPTS),
        ({wire.ATTEMPTS: b"\xff"}, wire.ATTEMPTS),
        ({wire.REDELIVERIES: "twice"}, wire.REDELIVERIES),
        ({wire.REDELIVERIES: -2}, wire.REDELIVERIES),
        ({wire.REDELIVERIES: {"n": 1}}, wire.REDELIVERIES),
        ({wire.ROUTING_KEY: 5}, wire.ROUTING_KEY),
        ({wire.ROUTING_KEY: b"orders.\xff"}, wire.ROUTING_KEY),  # py-amqp keeps invalid UTF-8 header text as bytes
        ({wire.ROUTING_KEY: None}, wire.ROUTING_KEY),
        ({"x-death": "rejected"}, "x-death"),
        ({"x-death": {"queue": QUEUE}}, "x-death"),
        ({"x-death": [None]}, "x-death"),
        ({"x-death": [_death(count="once")]}, "x-death"),
        ({"x-death": [_death(count=-1)]}, "x-death"),
        ({"x-death": [_death(count=10**30 * 1.0)]}, "x-death"),
        ({"x-death": [{"queue": QUEUE, "reason": "expired", "routing-keys": "orders.1"}]}, "x-death"),
        ({"x-death": [{"queue": QUEUE, "reason": "expired", "routing-keys": [b"orders.1"]}]}, "x-death"),
        ({"x-death": [{"queue": QUEUE, "reason": "expired", "routing-keys": {"k": 1}}]}, "x-death"),
    ],
)
def test_an_unreadable_header_is_named_and_nothing_is_raised(headers, named):
    properties = {"message_id": "m-1", "application_headers": headers}
    delivery = _read(properties)
    assert delivery.unreadable.startswith(f"unreadable header {named!r} ")
    assert (delivery.queue, delivery.routing_key, delivery.body, delivery.attempt) == (QUEUE, EVENT_KEY, BODY, 1)
    assert delivery.properties is properties


@pytest.mark.parametrize("properties, kind", [(None, "NoneType"), ([("message_id", "m")], "list"),
                                              ("content_type=json", "str"), (b"\x00", "bytes")])
def test_properties_that_are_not_a_table(properties, kind):
    delivery = _read(properties)
    assert delivery.unreadable == f"message properties are not a table: {kind}"
    assert (delivery.routing_key, delivery.body, delivery.properties, delivery.headers) == (EVENT_KEY, BODY, {}, {})


@pytest.mark.parametrize("headers, kind", [([1, 2], "list"), ("x-request-id=r1", "str"), (b"\x00\x01", "bytes"),
                                           (7, "int")])
def test_application_headers_that_are_not_a_table(headers, kind):
    delivery = _read({"application_headers": headers})
    assert delivery.unreadable == f"unreadable header 'application_headers' must be a table, got {kind}"


@pytest.mark.parametrize("headers", [[1, 2], "x-request-id=r1", 7])
def test_headers_that_are_not_a_table_read_as_empty(headers):
    assert _read({"application_headers": headers}).headers == {}


def test_the_lenient_decoders_marker_is_the_reason():
    reason = "property content_type is not valid UTF-8"
    properties = {"content_type": "application/\udcff", UNREADABLE: reason,
                  "application_headers": {wire.ROUTING_KEY: "orders.9.created"}}
    delivery = _read(properties)
    # the reason is the decoder's; what can be read is still read (the event's own key)
    assert (delivery.unreadable, delivery.routing_key) == (reason, "orders.9.created")
    assert delivery.properties is properties


def test_a_routing_key_that_is_not_utf8():
    key = wire.Undecoded.of(b"orders.\xff.created")  # as the wire guard decodes it
    delivery = _read({"application_headers": {wire.ATTEMPTS: 1}}, routing_key=key)
    assert (delivery.unreadable, delivery.routing_key) == ("routing key is not valid UTF-8", key)


@pytest.mark.parametrize("key", ["orders.ünïcödé", "заказ.создан", "orders.🦄"])
def test_a_routing_key_of_valid_utf8_is_read(key):
    delivery = _read({}, routing_key=key)
    assert (delivery.unreadable, delivery.routing_key) == ("", key)


@pytest.mark.parametrize(
    "body, expected",
    [
        (BODY, BODY),
        ('{"name": "Zoë"}', '{"name": "Zoë"}'.encode()),
        (b"caf\xe9".decode("utf-8", "surrogateescape"), b"caf\xe9"),  # a channel that decoded leniently
        ("", b""),
        (None, b""),
    ],
)
def test_the_body_is_always_bytes(body, expected):
    delivery = _read({}, body=body)
    assert delivery.body == expected and type(delivery.body) is bytes


def test_a_quorum_queues_delivery_count_says_how_often_a_message_was_redelivered():
    # A worker killed three times while holding it: the fourth delivery carries x-delivery-count 3.
    delivery = _read({"application_headers": {"x-delivery-count": 3}}, redelivered=True)
    assert (delivery.attempt, delivery.redeliveries, delivery.redelivered) == (1, 2, True)


@pytest.mark.parametrize("body, expected", [("\udcff", b"\xff"), ("\ud800", b"\xed\xa0\x80"),
                                            ("a\ud800\udcff", b"a\xed\xa0\x80\xed\xb3\xbf")])
def test_a_text_body_with_surrogates_becomes_bytes_without_raising(body, expected):
    assert read_delivery("q", body, {}, {}).body == expected
