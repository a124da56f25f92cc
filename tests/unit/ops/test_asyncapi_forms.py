"""What the AsyncAPI document says arrives (ops/asyncapi_forms.py): each handler's channel has the bare message and
a CloudEvent in structured mode (``application/cloudevents+json``, the payload under ``data``) and in binary mode
(``ce-*`` headers); a ``type=`` handler's type is the CloudEvents ``type`` there and the AMQP ``type`` property
(``messageType``) only on the bare message; a ``once=`` handler names its dedup key (``message_id``, to keep on a
retry); an outbox's publications are at least once. The CloudEvents a real publisher sends (the npm SDK's
structured JSON, byte for byte as tests/integration/test_envelopes_node.py receives it) fit the schemas, and the
worker's own unwrapping hands the handler exactly what the ``data`` schema describes.
tests/integration/test_asyncapi.py checks such a document with the reference parser."""
from __future__ import annotations

import json
from typing import Any

import celery
import pytest
import sqlalchemy as sa
from jsonschema import Draft7Validator
from pydantic import BaseModel

from kombu_events import Events
from kombu_events.core.codec import accept_set, decode
from kombu_events.core.envelopes import unwrap
from kombu_events.ops.asyncapi import document

from .test_asyncapi import refs, resolve

URL = "amqp://rabbit.example.com:5672/shop"
TYPE = "com.example.order.placed"


class OrderPlaced(BaseModel):
    order_id: int
    amount: float


def charge(order: OrderPlaced) -> None:
    """Charge the customer."""


def audit(payload):
    """Log every event."""


def raw(body):
    pass


def key_of(event) -> str:
    return f"order-{event.payload['order_id']}"


def service(*, outbox: bool = True) -> Events:
    app = celery.Celery("shop", broker=URL, set_as_current=False)
    events = Events(app, service="shop", database=sa.create_engine("sqlite://"), outbox=outbox)
    events.handler("orders.*.placed", type=TYPE, once=True)(charge)
    events.handler("audit.#", once=key_of)(audit)
    events.handler("raw.#", raw=True)(raw)
    events.publishes("orders.*.charged", OrderPlaced)
    return events


@pytest.fixture
def doc() -> dict[str, Any]:
    return document(service())


def messages_of(doc: dict[str, Any], operation: str) -> dict[str, dict[str, Any]]:
    """The operation's messages, resolved, by their key."""
    return {ref["$ref"].rsplit("/", 1)[-1]: resolve(doc, resolve(doc, ref["$ref"])["$ref"])
            for ref in doc["operations"][operation]["messages"]}


def validator(doc: dict[str, Any], schema: dict[str, Any]) -> Draft7Validator:
    """``schema`` with the document's components beside it, so that its ``#/components/...`` refs resolve."""
    return Draft7Validator({**schema, "components": doc["components"]})


def test_a_handler_receives_the_bare_message_and_both_cloudevents_modes(doc):
    found = messages_of(doc, "charge")
    assert list(found) == ["charge", "charge.cloudevents", "charge.cloudevents-binary"]
    bare, structured, binary = found.values()
    assert (bare["contentType"], bare["payload"]) == ("application/json", {"$ref": "#/components/schemas/OrderPlaced"})
    assert structured["contentType"] == "application/cloudevents+json"
    assert structured["x-kombu-events-envelope"] == "cloudevents-structured"
    assert structured["payload"]["properties"]["data"] == {"$ref": "#/components/schemas/OrderPlaced"}
    assert structured["payload"]["required"] == ["specversion", "id", "source", "type"]
    assert binary["headers"]["required"] == ["ce-specversion", "ce-id", "ce-source", "ce-type"]
    assert binary["payload"] == {"$ref": "#/components/schemas/OrderPlaced"}
    assert "`ce-`, `ce_`, `cloudEvents_`, `cloudEvents:`" in binary["description"]
    assert list(messages_of(doc, "raw")) == ["raw"], "raw=True unwraps nothing: the bare message only"
    channel = doc["channels"]["shop.charge"]["messages"]
    assert list(channel) == ["charge", "charge.cloudevents", "charge.cloudevents-binary"]


def test_the_type_is_the_cloudevents_type_and_the_amqp_type_property_only_for_a_bare_message(doc):
    bare, structured, binary = messages_of(doc, "charge").values()
    assert bare["bindings"]["amqp"]["messageType"] == TYPE  # the AMQP `type` property: a bare message's
    assert "bindings" not in structured and "bindings" not in binary
    assert structured["payload"]["properties"]["type"]["const"] == TYPE
    assert binary["headers"]["properties"]["ce-type"]["const"] == TYPE
    assert "the CloudEvents `type` attribute of a CloudEvent" in doc["operations"]["charge"]["description"]
    untyped = messages_of(doc, "audit")["audit.cloudevents"]["payload"]["properties"]["type"]
    assert untyped == {"type": "string", "minLength": 1}


def test_a_once_handler_names_its_dedup_key_which_publishers_keep_on_a_retry(doc):
    op = doc["operations"]["charge"]
    assert op["x-kombu-events-once"] == {"key": "message_id", "withoutMessageId": "sha256 of the routing key and "
                                         "the body", "stableOnRetries": True}
    assert "a publisher that sends an event again (a retry) must keep its `message_id`" in op["description"]
    bare, structured, binary = messages_of(doc, "charge").values()
    for message in (bare, structured, binary):
        assert "deduplicated by the AMQP `message_id` property" in message["description"]
    assert "not the CloudEvents `id`: set it to the id" in structured["description"]
    assert "CloudEvents" not in bare["description"]
    assert doc["operations"]["audit"]["x-kombu-events-once"] == {"key": f"{__name__}.key_of", "stableOnRetries": True}
    assert doc["operations"]["raw"]["x-kombu-events-once"] is None


def test_outbox_publications_are_said_to_be_delivered_at_least_once(doc):
    op = doc["operations"]["publish.orders.star.charged"]
    assert op["x-kombu-events-delivery"] == "at-least-once"
    assert "delivered **at least once**" in op["description"] and "same `message_id`" in op["description"]
    direct = document(service(outbox=False))["operations"]["publish.orders.star.charged"]
    assert "x-kombu-events-delivery" not in direct and "outbox" not in direct["description"]


def test_every_ref_resolves(doc):
    for ref in refs(doc):
        resolve(doc, ref)


#: A CloudEvent as the npm ``cloudevents`` SDK writes it in structured mode (HTTP.structured(event).body).
SDK_STRUCTURED = (b'{"id":"order-7-placed","time":"2024-05-01T10:00:00.123Z","type":"com.example.order.placed",'
                  b'"source":"/orders","specversion":"1.0","data":{"order_id":7,"amount":12.5}}')


def test_what_a_cloudevents_sdk_sends_fits_the_schemas_and_the_handler_gets_the_data(doc):
    _, structured, binary = messages_of(doc, "charge").values()
    event = json.loads(SDK_STRUCTURED)
    assert not list(validator(doc, structured["payload"]).iter_errors(event))
    other = {**event, "type": "com.example.order.lost"}
    assert any("const" in e.validator for e in validator(doc, structured["payload"]).iter_errors(other))
    both = {**event, "data_base64": "e30="}
    assert list(validator(doc, structured["payload"]).iter_errors(both)), "data and data_base64: not both"
    headers = {"ce-specversion": "1.0", "ce-id": "order-7-placed", "ce-source": "/orders", "ce-type": TYPE}
    assert not list(validator(doc, binary["headers"]).iter_errors(headers))
    assert list(validator(doc, binary["headers"]).iter_errors({"ce-id": "x"}))

    def decoding(body: bytes, content_type: str | None, content_encoding: str | None) -> Any:
        return decode(body, content_type, content_encoding, accept_set(["json"]))

    data, envelope = unwrap(SDK_STRUCTURED, "application/cloudevents+json", None, {}, {}, decoding)
    assert envelope is not None and envelope.type == TYPE
    assert not list(validator(doc, structured["payload"]["properties"]["data"]).iter_errors(data))
    binary_data, _ = unwrap(json.dumps(event["data"]).encode(), "application/json", None, headers, {}, decoding)
    assert binary_data == data and not list(validator(doc, binary["payload"]).iter_errors(binary_data))
