"""publisher.build_message: the message Events.publish sends (no connection involved)."""
from __future__ import annotations

import json
import time

import pytest

from kombu_events.errors import EncodeError, KombuEventsError
from kombu_events.publishing.publisher import PERSISTENT, build_message


def test_persistent_json_message():
    before = int(time.time())
    message = build_message({"order_id": 7, "name": "Zoë"})
    assert json.loads(message.body) == {"order_id": 7, "name": "Zoë"}
    assert message.body == b'{"order_id":7,"name":"Zo\\u00eb"}', "compact, ASCII-safe JSON"
    props = message.properties
    assert props["content_type"] == "application/json"
    assert props["content_encoding"] == "utf-8"
    assert props["delivery_mode"] == PERSISTENT == 2
    assert before <= props["timestamp"] <= int(time.time())
    assert props["application_headers"] == {}
    assert "correlation_id" not in props


def test_message_id_is_generated_and_unique_unless_given():
    generated = {build_message(None).properties["message_id"] for _ in range(100)}
    assert len(generated) == 100
    assert all(isinstance(mid, str) and len(mid) == 32 for mid in generated)
    assert build_message(None, message_id="order-7").properties["message_id"] == "order-7"


def test_headers_and_correlation_id():
    headers = {"x-request-id": "r1", "tenant": "acme"}
    message = build_message([1], headers=headers, correlation_id="c-9")
    assert message.properties["application_headers"] == headers
    assert message.properties["application_headers"] is not headers, "the caller's dict is copied"
    assert message.properties["correlation_id"] == "c-9"


@pytest.mark.parametrize("payload", [object(), {"when": time}, {1, 2}, b"bytes", {"n": 1j}])
def test_payload_that_is_not_json_raises_encode_error(payload):
    with pytest.raises(EncodeError, match="not JSON serialisable") as info:
        build_message(payload)
    assert isinstance(info.value, (KombuEventsError, TypeError))


@pytest.mark.parametrize("payload", [{"total": float("nan")}, {"total": float("inf")}])
def test_non_finite_numbers_are_not_json(payload):
    with pytest.raises(EncodeError):
        build_message(payload)
