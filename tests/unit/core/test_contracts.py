"""Typed contracts (core/contracts.py): validated payloads in the pool, validated publishing, on the test kit."""
from __future__ import annotations

import dataclasses
import datetime
import json
from typing import Any, Dict, List, Mapping, Optional

import celery
import pytest
from pydantic import BaseModel, Field
from typing_extensions import TypedDict

from kombu_events import ConfigurationError, Event, Events, signals
from kombu_events.core import decision
from kombu_events.core.contracts import MAX_ERRORS, Contract, contract_for, outgoing, untyped
from kombu_events.errors import InvalidPayload
from kombu_events.testing import StubEvents


class Customer(BaseModel):
    id: int
    email: str


class OrderCreated(BaseModel):
    order_id: int
    amount: float
    currency: str = Field(min_length=3, max_length=3)
    customer: Customer
    placed_at: datetime.datetime


@dataclasses.dataclass
class Shipment:
    order_id: int
    carrier: str


class Refund(TypedDict):
    order_id: int
    cents: int


GOOD = {"order_id": 7, "amount": 12.5, "currency": "EUR", "customer": {"id": 1, "email": "a@b.c"},
        "placed_at": "2026-11-25T10:00:00Z"}


@pytest.fixture
def events():
    app = celery.Celery("proj", broker="memory://", set_as_current=False)
    return Events(app, "shop", max_retries=3)


# -- which annotations make a contract ------------------------------------------------------------


@pytest.mark.parametrize("annotation", [Any, object, dict, Dict, Dict[str, Any],  # noqa: UP006 -- as users write
                                        dict[str, Any], Mapping, Mapping[str, Any]])
def test_annotations_that_promise_nothing_stay_unchecked(annotation):
    assert untyped(annotation)


@pytest.mark.parametrize("annotation", [OrderCreated, Shipment, Refund, int, List[int],  # noqa: UP006
                                        Dict[str, int], Optional[OrderCreated]])  # noqa: UP006
def test_every_other_annotation_is_a_contract(annotation):
    assert not untyped(annotation)
    assert Contract(annotation, where="t").schema()


def test_a_bound_handler_names_its_payload_type_as_event_of_it():
    def bound(event: Event[OrderCreated]) -> None: ...

    def plain_event(event: Event) -> None: ...

    def mistaken(event: OrderCreated) -> None: ...

    assert contract_for(bound, bind=True, raw=False, where="h").annotation is OrderCreated
    for unbound in (bound, plain_event):
        with pytest.raises(ConfigurationError, match="without bind=True the handler gets the payload"):
            contract_for(unbound, bind=False, raw=False, where="h")
    assert contract_for(plain_event, bind=True, raw=False, where="h") is None
    with pytest.raises(ConfigurationError, match=r"annotate it Event\[OrderCreated\]"):
        contract_for(mistaken, bind=True, raw=False, where="h")


def test_raw_handlers_get_bytes_whatever_their_annotation():
    def raw(body: OrderCreated) -> None: ...

    assert contract_for(raw, bind=False, raw=True, where="h") is None


def test_an_annotation_that_cannot_be_resolved_is_refused_at_registration(events):
    namespace: dict[str, Any] = {}
    exec("def handler(payload: NotImportedAnywhere): pass", namespace)  # this module's future import: a string
    with pytest.raises(ConfigurationError, match="cannot resolve the annotation 'NotImportedAnywhere'"):
        events.handler("orders.#")(namespace["handler"])


class Opaque:
    """A class pydantic has no schema for."""


def test_a_type_pydantic_cannot_validate_is_refused_at_registration(events):
    def handler(payload: Opaque) -> None: ...

    with pytest.raises(ConfigurationError, match="pydantic cannot validate Opaque"):
        events.handler("orders.#")(handler)


def test_without_pydantic_an_annotated_handler_is_refused_with_the_extra_to_install(events, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_pydantic(name, *args, **kwargs):
        if name == "pydantic" or name.startswith("pydantic."):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_pydantic)

    def handler(payload: OrderCreated) -> None: ...

    with pytest.raises(ConfigurationError, match=r"needs pydantic: pip install 'kombu-events\[pydantic\]'"):
        events.handler("orders.#")(handler)

    @events.handler("orders.#")
    def untyped_handler(payload: dict) -> None: ...  # no contract: registers without pydantic


# -- the reason of an invalid payload ---------------------------------------------------------------


def test_the_reason_names_each_field_its_message_and_the_input():
    with pytest.raises(InvalidPayload) as caught:
        Contract(OrderCreated, where="t").validate({**GOOD, "amount": "ten", "customer": {"id": "x"}})
    exc = caught.value
    paths = [path for path, _message, _given in exc.errors]
    assert paths == ["amount", "customer.id", "customer.email"]
    assert str(exc).startswith("payload does not fit OrderCreated: 3 errors: amount: Input should be a valid number")
    assert "(input: 'ten')" in str(exc)
    assert "customer.email: Field required" in str(exc)


def test_list_positions_are_written_as_indexes_and_long_inputs_are_cut():
    with pytest.raises(InvalidPayload) as caught:
        Contract(list[Shipment], where="t").validate([{"order_id": 1, "carrier": "x"}, {"order_id": "y" * 500}])
    (first, second) = caught.value.errors
    assert first[0] == "[1].order_id" and len(first[2]) == 80 and first[2].endswith("...")
    assert second[0] == "[1].carrier"


def test_a_payload_of_the_wrong_kind_is_one_error_on_the_payload_itself():
    with pytest.raises(InvalidPayload) as caught:
        Contract(OrderCreated, where="t").validate([1, 2])
    assert caught.value.errors == [("(payload)", "Input should be a valid dictionary or instance of OrderCreated",
                                    "[1, 2]")]


def test_at_most_twenty_errors_are_listed_and_the_rest_counted():
    with pytest.raises(InvalidPayload) as caught:
        Contract(list[int], where="t").validate(["x"] * 25)
    assert len(caught.value.errors) == MAX_ERRORS
    assert str(caught.value).startswith("payload does not fit list[int]: 25 errors")
    assert str(caught.value).endswith("; and 5 more")


def test_invalid_payload_survives_pickling():
    import pickle

    exc = InvalidPayload("X", [("a", "bad", "1")], 2)
    again = pickle.loads(pickle.dumps(exc))
    assert (again.contract, again.errors, again.more, str(again)) == (exc.contract, exc.errors, 2, str(exc))


# -- in the pool, on the test kit ---------------------------------------------------------------------


def test_valid_payloads_reach_the_handler_as_instances(events):
    @events.handler("orders.*.created")
    def on_order(order: OrderCreated) -> None: ...

    @events.handler("shipments.#")
    def on_shipment(shipment: Shipment) -> None: ...

    @events.handler("refunds.#")
    def on_refund(refund: Refund) -> None: ...

    with StubEvents(events) as stub:
        stub.publish("orders.7.created", GOOD)
        stub.publish("shipments.7", {"order_id": "7", "carrier": "dhl"})
        stub.publish("refunds.7", {"order_id": 7, "cents": 150})
        stub.join()
    (order,) = stub.calls(on_order)
    assert isinstance(order, OrderCreated) and order.customer.email == "a@b.c"
    assert order.placed_at == datetime.datetime(2026, 11, 25, 10, tzinfo=datetime.timezone.utc)
    assert stub.calls(on_shipment) == [Shipment(order_id=7, carrier="dhl")]
    assert stub.calls(on_refund) == [{"order_id": 7, "cents": 150}]
    assert [s.action for s in stub.settled] == ["ack"] * 3


def test_an_invalid_payload_is_archived_after_one_attempt_without_running_the_handler(events):
    ran = []

    @events.handler("orders.*.created", max_retries=5)
    def on_order(order: OrderCreated) -> None:
        ran.append(order)

    failed = []

    @signals.handler_failed.connect
    def record(sender, **kwargs):
        failed.append(kwargs)

    try:
        with StubEvents(events) as stub:
            stub.publish("orders.7.created", {**GOOD, "amount": "ten"})
            stub.join()
    finally:
        signals.handler_failed.disconnect(record)
    assert ran == []
    (archived,) = stub.archived
    assert (archived.action, archived.attempt, archived.outcome.kind) == ("archive", 1, decision.INVALID)
    assert archived.reason.startswith("payload does not fit OrderCreated: 1 error: amount: Input should be a valid "
                                      "number, unable to parse string as a number (input: 'ten')")
    assert stub.retried == []
    (signal,) = failed
    assert isinstance(signal["exception"], InvalidPayload) and signal["action"] == "archive"
    assert signal["outcome"].kind == decision.INVALID and signal["event"].payload["amount"] == "ten"
    assert json.loads(archived.body)["amount"] == "ten"  # the archived copy is the message as it came


def test_a_bound_handler_gets_the_instance_as_event_payload(events):
    @events.handler("orders.#", bind=True)
    def on_order(event: Event[OrderCreated]) -> None: ...

    with StubEvents(events) as stub:
        stub.publish("orders.7.created", GOOD)
        stub.join()
    (event,) = stub.calls(on_order)
    assert isinstance(event.payload, OrderCreated) and event.routing_key == "orders.7.created"


def test_unannotated_handlers_get_the_payload_as_decoded(events):
    @events.handler("orders.#")
    def on_order(payload):
        assert payload["amount"] == "ten"

    with StubEvents(events) as stub:
        stub.publish("orders.7.created", {"amount": "ten"})
        stub.join()
    assert [s.action for s in stub.settled] == ["ack"]


# -- publishing ------------------------------------------------------------------------------------


def test_publish_serialises_models_and_dataclasses_in_json_mode(events):
    @events.handler("#")
    def audit(payload: dict) -> None: ...

    order = OrderCreated.model_validate(GOOD)
    with StubEvents(events) as stub:
        events.publish("orders.7.created", order)
        events.publish("shipments.7", Shipment(7, "dhl"))
        stub.join()
    first, second = stub.calls(audit)
    assert first["placed_at"] == "2026-11-25T10:00:00Z" and first["customer"] == {"id": 1, "email": "a@b.c"}
    assert second == {"order_id": 7, "carrier": "dhl"}


def test_publish_refuses_a_payload_that_does_not_fit_what_the_service_declared_before_sending(events):
    events.publishes("orders.*.created", OrderCreated)

    @events.handler("#")
    def audit(payload: dict) -> None: ...

    with StubEvents(events) as stub:
        with pytest.raises(InvalidPayload, match="order_id: Field required"):
            events.publish("orders.7.created", {"amount": 1})
        with pytest.raises(InvalidPayload):
            events.publish_many([("orders.8.created", GOOD), ("orders.9.created", {})])
        events.publish("orders.7.cancelled", {"anything": True})  # not declared: as before
        events.publish("orders.7.created", {**GOOD, "order_id": "7"})
        stub.join()
    assert stub.published and [m.routing_key for m in stub.published] == ["orders.7.cancelled", "orders.7.created"]
    assert stub.calls(audit)[1]["order_id"] == 7  # sent as validated: the contract's form


def test_publishes_checks_its_pattern_and_type_at_once(events):
    with pytest.raises(ConfigurationError, match="wildcard must be a whole word"):
        events.publishes("orders.x*", OrderCreated)
    with pytest.raises(ConfigurationError, match="pydantic cannot validate"):
        events.publishes("orders.#", type("Opaque", (), {}))
    assert events.publications == ()
    declared = events.publishes("orders.#", OrderCreated)
    assert events.publications == (declared,) and declared.pattern == "orders.#"


def test_an_event_function_validates_its_annotated_arguments(events):
    @events.event("orders.created")
    def order_created(order_id: int, customer: Customer, note: str = "", extra=None) -> None: ...

    @events.handler("orders.#")
    def audit(payload: dict) -> None: ...

    with StubEvents(events) as stub:
        with pytest.raises(InvalidPayload) as caught:
            order_created("seven", {"id": 1})
        order_created("7", {"id": 1, "email": "a@b.c"}, extra={"x": 1})
        stub.join()
    assert [path for path, _m, _i in caught.value.errors] == ["order_id", "customer.email"]
    assert stub.calls(audit) == [{"order_id": 7, "customer": {"id": 1, "email": "a@b.c"}, "note": "",
                                  "extra": {"x": 1}}]


def test_outgoing_leaves_plain_json_alone():
    payload = {"a": [1, 2]}
    assert outgoing(payload) is payload
    assert outgoing(OrderCreated.model_validate(GOOD))["currency"] == "EUR"


# -- envelopes and message types, through the pool's code -------------------------------------------


CE_STRUCTURED = "application/cloudevents+json"


def _cloudevent(data: Any, **attributes: Any) -> dict[str, Any]:
    return {"specversion": "1.0", "id": "ev-1", "source": "/orders", "type": "com.example.order.placed",
            "time": "2026-11-25T10:00:00Z", **attributes, "data": data}


def test_a_structured_cloudevent_reaches_a_typed_handler_with_its_envelope(events):
    @events.handler("orders.#", bind=True)
    def on_order(event: Event[OrderCreated]) -> None: ...

    with StubEvents(events) as stub:
        stub.publish("orders.7.created", json.dumps(_cloudevent(GOOD)).encode(), content_type=CE_STRUCTURED)
        stub.join()
    (event,) = stub.calls(on_order)
    assert isinstance(event.payload, OrderCreated)
    envelope = event.envelope
    assert (envelope.kind, envelope.id, envelope.source, envelope.type) == (
        "cloudevents", "ev-1", "/orders", "com.example.order.placed")
    assert envelope.time == datetime.datetime(2026, 11, 25, 10, tzinfo=datetime.timezone.utc)


def test_a_binary_cloudevent_is_read_from_its_headers(events):
    @events.handler("orders.#", bind=True)
    def on_order(event: Event[OrderCreated]) -> None: ...

    headers = {"cloudEvents_specversion": "1.0", "cloudEvents_id": "ev-2", "cloudEvents_source": "/orders",
               "cloudEvents_type": "com.example.order.placed"}
    with StubEvents(events) as stub:
        stub.publish("orders.7.created", GOOD, headers=headers)
        stub.join()
    (event,) = stub.calls(on_order)
    assert event.payload.order_id == 7 and (event.envelope.kind, event.envelope.id) == ("cloudevents", "ev-2")


def test_an_invalid_payload_inside_an_envelope_is_archived_with_the_field_named(events):
    @events.handler("orders.#")
    def on_order(order: OrderCreated) -> None: ...

    with StubEvents(events) as stub:
        stub.publish("orders.7.created", json.dumps(_cloudevent({**GOOD, "currency": "EURO"})).encode(),
                     content_type=CE_STRUCTURED)
        stub.join()
    (archived,) = stub.archived
    assert archived.outcome.kind == decision.INVALID and "currency: String should have at most 3 characters" in (
        archived.reason)


def test_a_malformed_envelope_is_archived_at_once_with_the_reason(events):
    ran = []

    @events.handler("orders.#", max_retries=5)
    def on_order(payload) -> None:
        ran.append(payload)

    broken = _cloudevent(GOOD)
    del broken["source"]
    with StubEvents(events) as stub:
        stub.publish("orders.7.created", json.dumps(broken).encode(), content_type=CE_STRUCTURED)
        stub.join()
    (archived,) = stub.archived
    assert ran == [] and archived.attempt == 1 and archived.outcome.kind == decision.UNDECODABLE
    assert "source" in archived.reason and "CloudEvents" in archived.reason


def test_a_handler_bound_to_a_type_runs_only_for_that_type_and_acks_the_others(events):
    @events.handler(type="com.example.order.placed")
    def placed(payload) -> None: ...

    @events.handler("orders.#", type="Shop.OrderShipped")
    def shipped(payload) -> None: ...

    assert [h.binding_keys for h in events.handlers] == [("#",), ("orders.#",)]
    with StubEvents(events) as stub:
        stub.publish("orders.1", json.dumps(_cloudevent({"n": 1})).encode(), content_type=CE_STRUCTURED)
        stub.publish("orders.2", {"n": 2}, properties={"type": "Shop.OrderShipped"})
        stub.publish("orders.3", {"n": 3}, headers={"__TypeId__": "com.example.Other"})
        stub.join()
    assert stub.calls(placed) == [{"n": 1}]
    assert stub.calls(shipped) == [{"n": 2}]
    by_queue: dict[str, list[str]] = {}
    for s in stub.settled:
        by_queue.setdefault(s.queue, []).append(f"{s.action}:{s.outcome.kind}")
    assert by_queue == {"shop.placed": ["ack:ok", "ack:skipped", "ack:skipped"],
                        "shop.shipped": ["ack:skipped", "ack:ok", "ack:skipped"]}


@pytest.mark.parametrize("bad", ["", "  ", 7])
def test_type_must_name_a_type(events, bad):
    with pytest.raises(ConfigurationError, match="type must be a non-empty string"):
        events.handler(type=bad)
    with pytest.raises(ConfigurationError, match=r"or type='\.\.\.'"):
        events.handler()


def test_a_decorated_handler_is_validated_by_the_annotation_of_the_function_it_wraps(events):
    library: dict[str, Any] = {}  # a decorator from another module: its globals do not know OrderCreated
    exec("import functools\n"
         "def logged(fn):\n"
         "    @functools.wraps(fn)\n"
         "    def call(payload):\n"
         "        return fn(payload)\n"
         "    return call\n", library)
    logged = library["logged"]

    @events.handler("orders.#")
    @logged
    def on_order(order: OrderCreated) -> None:  # a string, with this module's future import
        assert isinstance(order, OrderCreated)

    (handler,) = events.handlers
    assert handler.contract is not None and handler.contract.annotation is OrderCreated
