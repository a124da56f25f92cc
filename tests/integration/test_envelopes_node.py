"""CloudEvents from the npm ``cloudevents`` SDK, published by Node.js to the real broker in structured
and binary mode, read back by a plain kombu consumer and unwrapped by ``core.envelopes``.

No kombu-events worker takes part: this checks what arrives on the wire from a real SDK.
"""
from __future__ import annotations

import base64
import json
import subprocess
from datetime import datetime, timezone
from typing import Any

import pytest
from kombu import Connection, Consumer, Exchange, Queue

from kombu_events.core.codec import accept_set, decode as codec_decode
from kombu_events.core.envelopes import unwrap

from .harness import NODE_DIR, unique, wait_for

pytestmark = pytest.mark.integration

JSON_ONLY = accept_set(["json"])
TIME = "2024-05-01T10:00:00.123Z"  # the SDK keeps milliseconds


def decode(body: bytes, content_type: str | None, content_encoding: str | None) -> Any:
    return codec_decode(body, content_type, content_encoding, JSON_ONLY)


def cloudevents_publish(broker_url: str, exchange: str, mode: str, prefix: str | None,
                        events: list[dict[str, Any]]) -> None:
    args = ["node", str(NODE_DIR / "cloudevents_publish.js"), broker_url, exchange, mode]
    if prefix:
        args.append(f"--prefix={prefix}")
    result = subprocess.run(args, input=json.dumps(events), text=True, capture_output=True, timeout=60, cwd=NODE_DIR)
    assert result.returncode == 0, result.stderr


def received(broker_url: str, queue: Queue, count: int) -> list[Any]:
    """``count`` messages of ``queue``, through a plain kombu consumer (acked)."""
    messages: list[Any] = []
    # on_message: the raw message, which kombu would otherwise decode by its own accept list first
    with Connection(broker_url) as conn, Consumer(conn, [queue], on_message=messages.append):
        def drained() -> bool:
            try:
                conn.drain_events(timeout=0.2)
            except TimeoutError:
                pass
            return len(messages) >= count
        wait_for(drained, timeout=20, what=f"{count} messages on {queue.name}")
        for message in messages:
            message.ack()
    return messages


@pytest.mark.parametrize(("mode", "prefix"), [("structured", None), ("binary", "ce-"), ("binary", "cloudEvents_")])
def test_sdk_events_arrive_and_unwrap(broker_url, mode, prefix):
    exchange = Exchange(unique("ex-ce"), "topic", durable=True)  # as the script asserts it
    queue = Queue(unique("q-ce"), exchange, routing_key="orders.#", durable=True, auto_delete=False)
    ids = [unique("ce-"), unique("ce-")]
    events = [
        {"routing_key": "orders.placed", "type": "com.example.order.placed", "source": "/orders", "id": ids[0],
         "time": TIME, "data": {"order": 1, "lines": ["a", "b"]}},
        # bytes: data_base64 in structured mode, the raw bytes as the body in binary mode
        {"routing_key": "orders.paid", "type": "com.example.order.paid", "source": "/payments", "id": ids[1],
         "time": TIME, "datacontenttype": "application/json",
         "data_base64": base64.b64encode(b'{"paid": true}').decode()},
    ]
    with Connection(broker_url) as conn:
        queue(conn.default_channel).declare()  # declares the exchange too
    try:
        cloudevents_publish(broker_url, exchange.name, mode, prefix, events)
        messages = sorted(received(broker_url, queue, 2), key=lambda m: m.delivery_info["routing_key"])
    finally:
        with Connection(broker_url) as conn:
            queue(conn.default_channel).delete()
            exchange(conn.default_channel).delete()

    expected = {ids[0]: ("com.example.order.placed", "/orders", {"order": 1, "lines": ["a", "b"]}),
                ids[1]: ("com.example.order.paid", "/payments", {"paid": True})}
    for message in messages:
        if mode == "structured":
            assert message.content_type.startswith("application/cloudevents+json")
        else:
            assert any(name.startswith(prefix) for name in message.headers), message.headers
        payload, envelope = unwrap(message.body, message.content_type, message.content_encoding, message.headers,
                                   message.properties, decode)
        assert envelope is not None and envelope.kind == "cloudevents"
        assert (envelope.type, envelope.source, payload) == expected.pop(envelope.id)
        assert envelope.time == datetime(2024, 5, 1, 10, 0, 0, 123000, tzinfo=timezone.utc)
        assert envelope.attributes["specversion"] == "1.0"
    assert expected == {}
