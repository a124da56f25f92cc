"""Typed contracts against a real worker and non-Python publishers (docs/contracts.md).

Node.js publishes (amqplib, and the CloudEvents SDK in structured and binary mode); a
prefork worker validates each payload into a pydantic model in its pool. Valid events
reach the handler as model instances with their envelope; invalid ones are archived
after one attempt, with reasons that name the field, and never reach the handler.
"""
from __future__ import annotations

import json
import subprocess
import time

import pytest

from .harness import NODE_DIR, get_messages, node_message, queue_depth, wait_for

pytestmark = pytest.mark.integration

TYPED_APP = """
from datetime import datetime
from pydantic import BaseModel

class Customer(BaseModel):
    id: int
    email: str

class OrderPlaced(BaseModel):
    order_id: int
    amount: float
    customer: Customer
    placed_at: datetime

events = Events(app, service=SERVICE, exchange=EXCHANGE, max_retries=3)

@events.handler("orders.*.placed", bind=True)
def placed(event: Event[OrderPlaced]):
    order, envelope = event.payload, event.envelope
    record(handler="placed", model=type(order).__name__, order_id=order.order_id, email=order.customer.email,
           placed_at=order.placed_at.isoformat(), attempt=event.attempt,
           envelope=envelope and {"kind": envelope.kind, "id": envelope.id, "source": envelope.source,
                                  "type": envelope.type})
"""

PLACED_AT = "2026-11-25T10:00:00+00:00"


def order(n: int, **changes: object) -> dict[str, object]:
    return {"order_id": n, "amount": 10.5 + n, "customer": {"id": n, "email": f"c{n}@example.com"},
            "placed_at": PLACED_AT, **changes}


def cloudevents_publish(url: str, exchange: str, mode: str, events: list[dict[str, object]],
                        prefix: str = "ce-") -> None:
    """Publish with the npm ``cloudevents`` SDK and amqplib (tests/node/cloudevents_publish.js)."""
    subprocess.run(["node", str(NODE_DIR / "cloudevents_publish.js"), url, exchange, mode, f"--prefix={prefix}"],
                   input=json.dumps(events), text=True, check=True, capture_output=True, timeout=60, cwd=NODE_DIR)


def archived_reasons(project) -> dict[str, str]:
    messages = get_messages(project.broker_url, f"{project.service}.archive")
    return {m.properties["message_id"]: m.headers["kombu-events-reason"] for m in messages}


def test_bare_json_from_node_valid_to_the_model_invalid_archived_after_one_attempt(make_project):
    project = make_project(TYPED_APP)
    project.worker(pool="prefork", concurrency=2).wait_ready()
    project.node_publish(
        node_message("orders.1.placed", order(1), messageId="ok-1"),
        node_message("orders.2.placed", order(2, amount="ten"), messageId="bad-amount"),
        node_message("orders.3.placed", order(3, order_id="7"), messageId="ok-3"),  # "7" fits int: coerced
        node_message("orders.4.placed", order(4, customer={"id": 4}), messageId="bad-email"),
        node_message("orders.5.placed", order(5, placed_at="yesterday", order_id=None), messageId="bad-two"),
        node_message("orders.6.placed", order(6), messageId="ok-6"))

    archive = f"{project.service}.archive"
    wait_for(lambda: len(project.records()) >= 3 and queue_depth(project.broker_url, archive)[0] >= 3,
             what="3 handled and 3 archived")
    time.sleep(1.5)  # a retry would be back after the default 1 s backoff
    records = project.records()
    assert sorted(r["order_id"] for r in records) == [1, 6, 7]
    assert {(r["model"], r["attempt"], r["envelope"]) for r in records} == {("OrderPlaced", 1, None)}
    assert {r["placed_at"] for r in records} == {PLACED_AT}

    reasons = archived_reasons(project)
    assert set(reasons) == {"bad-amount", "bad-email", "bad-two"}
    assert reasons["bad-amount"].startswith("payload does not fit OrderPlaced: 1 error: amount: Input should be a "
                                            "valid number")
    assert "(input: 'ten')" in reasons["bad-amount"]
    assert reasons["bad-email"].startswith("payload does not fit OrderPlaced: 1 error: customer.email: Field required")
    assert reasons["bad-two"].startswith("payload does not fit OrderPlaced: 2 errors: order_id: ")
    assert "placed_at: Input should be a valid datetime" in reasons["bad-two"]
    wait_for(lambda: project.settled("placed"), timeout=5, what="the handler queue empty, nothing unacked")


@pytest.mark.parametrize("mode, prefix", [("structured", "ce-"), ("binary", "ce-"), ("binary", "cloudEvents_")])
def test_cloudevents_sdk_reaches_a_model_handler_with_id_source_and_type(make_project, mode, prefix):
    project = make_project(TYPED_APP)
    project.worker(pool="prefork", concurrency=2).wait_ready()
    cloudevents_publish(project.broker_url, project.exchange, mode, [
        {"routing_key": "orders.1.placed", "id": "ce-1", "source": "/shop/orders", "type": "shop.order.placed",
         "datacontenttype": "application/json", "data": order(1)},
        {"routing_key": "orders.2.placed", "id": "ce-2", "source": "/shop/orders", "type": "shop.order.placed",
         "datacontenttype": "application/json", "data": order(2, customer={"id": "two"})},
    ], prefix=prefix)

    archive = f"{project.service}.archive"
    wait_for(lambda: project.records() and queue_depth(project.broker_url, archive)[0] >= 1,
             what="1 handled and 1 archived")
    (record,) = project.records()
    assert (record["model"], record["order_id"], record["email"]) == ("OrderPlaced", 1, "c1@example.com")
    assert record["envelope"] == {"kind": "cloudevents", "id": "ce-1", "source": "/shop/orders",
                                  "type": "shop.order.placed"}
    (archived,) = get_messages(project.broker_url, archive)
    reason = archived.headers["kombu-events-reason"]
    assert reason.startswith("payload does not fit OrderPlaced: 2 errors: customer.id: Input should be a valid "
                             "integer"), reason
    assert "customer.email: Field required" in reason
