"""Content types against a real worker: JSON by default, an accept list, raw bodies, the archive.

A body that cannot be decoded never reaches its handler: it goes to ``<service>.archive``
with a ``kombu-events-reason`` header, an ERROR line is logged, and consuming goes on.
"""
from __future__ import annotations

import json
import time

import pytest

from .harness import get_messages, node_message as message, publish_amqp, queue_depth, wait_for

pytestmark = pytest.mark.integration

CONTENT_APP = """
events = Events(app, service=SERVICE, exchange=EXCHANGE)

@events.handler("ct.json")
def js(payload):
    record(handler="json", payload=payload)

@events.handler("ct.raw", raw=True)
def raw(body):
    record(handler="raw", type=type(body).__name__, body=body.decode("utf-8"))
"""

PICKLE = "(dp0\nVn\np1\nI9\ns."  # pickle.dumps({"n": 9}, protocol=0)


def test_undecodable_and_unaccepted_bodies_are_archived_and_consuming_goes_on(make_project):
    project = make_project(CONTENT_APP)
    worker = project.worker().wait_ready()
    project.node_publish(
        message("ct.json", "{not json", messageId="bad-json"),
        message("ct.json", {"n": 1}),
        message("ct.json", PICKLE, contentType="application/x-python-serialize", messageId="pickle"),
        message("ct.json", {"n": 2}),
        message("ct.json", "hello", contentType="text/plain", messageId="text"),
        message("ct.json", {"n": 3}),
        message("ct.json", {"n": 4}, contentType=None),
        message("ct.raw", "not json, caf\u00e9", contentType="application/json"))

    wait_for(lambda: len(project.records()) >= 5, what="5 handler calls")
    archive = f"{project.service}.archive"
    wait_for(lambda: queue_depth(project.broker_url, archive)[0] >= 3, what="3 archived")
    time.sleep(1.0 + 0.5)  # a retry would come back after the default 1 s backoff, on the default 1 s unit
    assert sorted(r["payload"]["n"] for r in project.records(handler="json")) == [1, 2, 3, 4]
    assert project.records(handler="raw")[0]["type"] == "bytes"
    assert project.records(handler="raw")[0]["body"] == "not json, caf\u00e9"

    messages = get_messages(project.broker_url, archive)
    archived = {m.properties["message_id"]: m for m in messages}
    assert set(archived) == {"bad-json", "pickle", "text"} and len(messages) == 3
    assert "not valid JSON" in archived["bad-json"].headers["kombu-events-reason"]
    assert "'application/x-python-serialize' is not accepted" in archived["pickle"].headers["kombu-events-reason"]
    assert "'text/plain' is not accepted" in archived["text"].headers["kombu-events-reason"]
    # Body and properties are never rewritten.
    assert archived["pickle"].body == PICKLE.encode()
    assert archived["pickle"].properties["content_type"] == "application/x-python-serialize"
    assert archived["bad-json"].headers["kombu-events-queue"] == f"{project.service}.js"

    wait_for(lambda: project.settled("js", "raw"), timeout=5, what="events acked")
    errors = [line for line in worker.log.splitlines() if "outcome=archive" in line]
    assert len(errors) == 3 and all("ERROR" in line for line in errors), errors
    assert any("not valid JSON" in line for line in errors)
    assert sum("is not accepted" in line for line in errors) == 2


def test_json_content_type_with_parameters_or_another_case_is_json(make_project):
    project = make_project(CONTENT_APP)
    project.worker().wait_ready()
    project.node_publish(message("ct.json", {"n": 1}, contentType="application/json; charset=utf-8"),
                         message("ct.json", {"n": 2}, contentType="Application/JSON"))

    wait_for(lambda: len(project.records()) >= 2, what="2 handler calls")
    assert sorted(r["payload"]["n"] for r in project.records(handler="json")) == [1, 2]
    assert queue_depth(project.broker_url, f"{project.service}.archive")[0] == 0


LATIN = {"name": "Zo\u00eb", "city": "K\u00f6ln", "note": "se\u00f1or \u00bd"}
WIDE = {"name": "Zo\u00eb", "price": "12 \u20ac", "city": "\u6771\u4eac", "emoji": "\U0001f600"}


def publish_json(project, payload, encoding: str, label: str, message_id: str) -> None:
    """Publish ``payload`` as JSON encoded in ``encoding``, labelled ``content_encoding=label``."""
    body = json.dumps(payload, ensure_ascii=False).encode(encoding)
    publish_amqp(project.broker_url, project.exchange, "ct.json", body, message_id=message_id,
                 content_type="application/json", content_encoding=label)


def test_json_in_its_labelled_content_encoding_reaches_the_handler_decoded(make_project):
    project = make_project(CONTENT_APP)
    project.worker().wait_ready()
    sent = [(LATIN, "latin-1", "latin-1"), (WIDE, "utf-16", "utf-16"), (WIDE, "utf-8", "utf-8")]
    for n, (payload, encoding, label) in enumerate(sent):
        publish_json(project, {**payload, "n": n}, encoding, label, f"m-{label}")

    wait_for(lambda: len(project.records()) >= len(sent), what=f"{len(sent)} handler calls")
    got = sorted((r["payload"] for r in project.records(handler="json")), key=lambda p: p["n"])
    assert got == [{**payload, "n": n} for n, (payload, _, _) in enumerate(sent)]
    assert queue_depth(project.broker_url, f"{project.service}.archive")[0] == 0


@pytest.mark.parametrize("payload, encoding, label", [
    (LATIN, "latin-1", "utf-8"),
    (WIDE, "utf-16", "utf-8"),
], ids=["latin-1 as utf-8", "utf-16 as utf-8"])
def test_json_in_another_encoding_than_its_label_is_archived_as_undecodable(make_project, payload, encoding,
                                                                            label):
    project = make_project(CONTENT_APP)
    worker = project.worker().wait_ready()
    publish_json(project, payload, encoding, label, "mislabelled")
    body = json.dumps(payload, ensure_ascii=False).encode(encoding)

    archive = f"{project.service}.archive"
    wait_for(lambda: queue_depth(project.broker_url, archive)[0] >= 1 or project.records(),
             what="the message archived (or handled)")
    assert project.records() == []
    [archived] = get_messages(project.broker_url, archive)
    assert archived.properties["message_id"] == "mislabelled"
    assert f"not valid JSON in {label}" in archived.headers["kombu-events-reason"]
    assert archived.body == body and archived.properties["content_encoding"] == label
    wait_for(lambda: "outcome=archive" in worker.log, timeout=5, what="the archive logged")


PICKLE_APP = """
events = Events(app, service=SERVICE, exchange=EXCHANGE, accept_content=["json", "pickle"])

@events.handler("ct.any")
def anything(payload):
    record(payload=payload)
"""


def test_pickle_is_decoded_once_explicitly_accepted(make_project):
    project = make_project(PICKLE_APP)
    project.worker().wait_ready()
    project.node_publish(message("ct.any", PICKLE, contentType="application/x-python-serialize"),
                         message("ct.any", {"n": 1}))

    wait_for(lambda: len(project.records()) >= 2, what="2 handler calls")
    assert sorted(r["payload"]["n"] for r in project.records()) == [1, 9]


RELAY_APP = """
events = Events(app, service=SERVICE, exchange=EXCHANGE, delay_unit_ms=100, delay_levels=8,
                max_retries=1, backoff=Constant(every_ms=100))

def own(headers):
    return {k: repr(v) for k, v in headers.items() if not k.startswith(("kombu-events-", "x-"))}

@events.handler("relay.#", bind=True)
def relay(event):
    properties = {k: repr(v) for k, v in event.properties.items() if k != "application_headers"}
    record(attempt=event.attempt, body=event.body.decode(), headers=own(event.headers), properties=properties)
    if event.attempt == 1:
        raise RuntimeError("once more")
    raise Archive("keep it")
"""

# One header of each AMQP field type amqplib can send.
TYPED_HEADERS = {
    "int8": {"!": "int8", "value": -5}, "uint8": {"!": "uint8", "value": 200},
    "int16": {"!": "int16", "value": -300}, "uint16": {"!": "uint16", "value": 60000},
    "int32": {"!": "int32", "value": -70000}, "uint32": {"!": "uint32", "value": 4000000000},
    "int64": {"!": "int64", "value": 2**40}, "float": {"!": "float", "value": 1.5},
    "double": {"!": "double", "value": 2.25}, "decimal": {"!": "decimal", "value": {"places": 2, "digits": 314}},
    "timestamp": {"!": "timestamp", "value": 1700000000}, "null": None, "bool": True,
    "nested": {"a": 1, "b": "x"}, "array": [1, "two", True], "text": "caf\u00e9",
}


def test_body_headers_and_properties_survive_the_ladder_and_the_archive(make_project):
    project = make_project(RELAY_APP)
    project.worker().wait_ready()
    body = '{"z": 1,  "a": [1, 2]}'  # odd spacing: the bytes must not be re-encoded
    project.node_publish(message("relay.x", body, messageId="m-1", correlationId="c-1", appId="node",
                                 type="relay.x", replyTo="replies", userId="guest", timestamp=1700000000,
                                 contentEncoding="utf-8", headers=TYPED_HEADERS))

    archive = f"{project.service}.archive"
    wait_for(lambda: queue_depth(project.broker_url, archive)[0] >= 1, what="archived after 2 attempts")
    first, second = sorted(project.records(), key=lambda r: r["attempt"])
    assert (first["attempt"], second["attempt"]) == (1, 2)
    assert first["body"] == second["body"] == body
    assert set(first["headers"]) == set(TYPED_HEADERS)
    assert second["headers"] == first["headers"]
    assert second["properties"] == first["properties"]
    assert "'m-1'" in first["properties"].values() and "'guest'" in first["properties"].values()

    [archived] = get_messages(project.broker_url, archive)
    assert archived.body.decode() == body
    headers = dict(archived.properties["application_headers"])
    assert {k: repr(headers[k]) for k in TYPED_HEADERS} == first["headers"]
    properties = {k: repr(v) for k, v in archived.properties.items() if k != "application_headers"}
    assert properties == first["properties"]
    assert headers["kombu-events-reason"] == "keep it"


EXPIRING_APP = """
events = Events(app, service=SERVICE, exchange=EXCHANGE)

@events.handler("exp.archive")
def archive_it(payload):
    raise Archive("keep me")
"""


def test_a_publisher_expiration_does_not_empty_the_archive(make_project):
    """A per-message TTL governs the first delivery only; the archive's own limits apply after."""
    project = make_project(EXPIRING_APP)
    project.worker().wait_ready()
    project.node_publish(message("exp.archive", {"n": 1}, expiration="1500", messageId="short-lived"))
    archive = f"{project.service}.archive"
    wait_for(lambda: queue_depth(project.broker_url, archive)[0] == 1, what="archived")
    time.sleep(2.5)  # well past the publisher's 1.5 s expiration
    [archived] = get_messages(project.broker_url, archive)
    assert archived.properties["message_id"] == "short-lived"
    assert "expiration" not in archived.properties
    assert archived.headers["kombu-events-expiration"] == "1500"
