"""The test kit is tested like the product: one project module, five scenarios, the same decisions from
the stub (``StubEvents``, in a process of its own) as from a real `celery worker` on the real RabbitMQ.

A middleware of the project records every settlement (attempt, action, outcome kind, delay, reason, the
copy's headers), wherever the message was settled; the archive is compared message by message.
"""
from __future__ import annotations

import json
import re

import pytest

from kombu_events.core import wire

from .harness import get_messages, publish_amqp, wait_for

pytestmark = pytest.mark.integration

PROJECT = """
from kombu_events.core import wire
from kombu_events.core.settlement import Republish

VIA = os.environ.get("PARITY_VIA", "worker")

class Decisions(Middleware):
    def settled(self, delivery, outcome, step):
        headers = step.properties["application_headers"] if isinstance(step, Republish) else {}
        record(via=VIA, message_id=delivery.message_id, queue=delivery.queue, attempt=delivery.attempt,
               action=step.action, kind=outcome.kind, delay_ms=step.delay_ms, reason=step.reason,
               copy_attempts=headers.get(wire.ATTEMPTS), copy_reason=headers.get(wire.REASON),
               copy_routing_key=headers.get(wire.ROUTING_KEY), tenant=headers.get("tenant"))

events = Events(app, service=SERVICE, exchange=EXCHANGE, delay_unit_ms=100, delay_levels=8,
                backoff=Exponential(base_ms=200, max_delay_ms=1000), middleware=[Decisions()])

@events.handler("parity.flaky", bind=True)
def flaky(event):
    if event.attempt < 3:
        raise RuntimeError(f"flaky failure on attempt {event.attempt}")

@events.handler("parity.poison")
def poison(payload):
    with poisonous():
        int(payload["n"])

@events.handler("parity.later", bind=True)
def later(event):
    if event.attempt == 1:
        raise Retry(delay=0.3)

@events.handler("parity.exhausted", max_retries=2)
def exhausted(payload):
    raise RuntimeError("always fails")

@events.handler("parity.#.undecodable")
def undecodable(payload):
    record(via=VIA, unexpected="the handler of an undecodable body ran")
"""

#: scenario: (routing key, body); the scenario's name is its message id.
SCENARIOS = {
    "retry-then-succeed": ("parity.flaky", b'{"n": 1}'),
    "poisonous": ("parity.poison", b'{"n": "x"}'),
    "retry-with-delay": ("parity.later", b"{}"),
    "max-retries-exhausted": ("parity.exhausted", b"{}"),
    "undecodable": ("parity.undecodable", b"{not json"),
}
#: how many settlements end each scenario
SETTLEMENTS = {"retry-then-succeed": 3, "poisonous": 1, "retry-with-delay": 2, "max-retries-exhausted": 3,
               "undecodable": 1}
HEADERS = {"tenant": "acme"}

STUB = """
import json, os
os.environ["PARITY_VIA"] = "stub"
from {module} import events
from kombu_events.testing import StubEvents

stub = StubEvents(events)
for message_id, (routing_key, body) in {scenarios!r}.items():
    stub.publish(routing_key, body, message_id=message_id, headers={headers!r})
stub.advance(60, fail_fast=False)
print(json.dumps({{
    "settled": [[s.message_id, s.attempt, s.action, s.outcome.kind, s.delay_ms, s.reason] for s in stub.settled],
    "archived": [[s.message_id, s.body.hex(), {{k: str(v) for k, v in s.headers.items()}}] for s in stub.archived],
    "pending": len(stub.pending),
}}))
"""

#: archived headers that must be equal (times and tracebacks differ by nature)
COMPARED = (wire.REASON, wire.ATTEMPTS, wire.QUEUE, wire.ROUTING_KEY, wire.EXCEPTION, "tenant")


def decisions(records: list[dict]) -> dict[str, list[tuple]]:
    """{message id: [(attempt, action, kind, delay_ms, reason, copy headers...), ...]} in order."""
    found: dict[str, list[tuple]] = {}
    for r in records:
        found.setdefault(r["message_id"], []).append(
            (r["attempt"], r["action"], r["kind"], r["delay_ms"], r["reason"], r["copy_attempts"], r["copy_reason"],
             r["copy_routing_key"], r["tenant"]))
    return found


def test_the_stub_decides_as_a_real_worker_on_the_real_broker(make_project):
    project = make_project(PROJECT)

    result = project.run_python(STUB.format(module=project.module, scenarios=SCENARIOS, headers=HEADERS))
    assert result.returncode == 0, result.stderr
    stub = json.loads(result.stdout.splitlines()[-1])

    project.worker().wait_ready()
    for message_id, (routing_key, body) in SCENARIOS.items():
        publish_amqp(project.broker_url, project.exchange, routing_key, body, message_id=message_id,
                     content_type="application/json", content_encoding="utf-8", delivery_mode=2,
                     application_headers=HEADERS)
    wait_for(lambda: len(project.records(via="worker")) >= sum(SETTLEMENTS.values()), timeout=30,
             what="every scenario settled by the worker")
    archive = get_messages(project.broker_url, f"{project.service}.archive")

    by_worker, by_stub = decisions(project.records(via="worker")), decisions(project.records(via="stub"))
    assert by_stub == by_worker
    assert {k: len(v) for k, v in by_worker.items()} == SETTLEMENTS
    assert not [r for r in project.records() if "unexpected" in r]

    # What the kit records is what its middleware saw, and what the worker did.
    assert [tuple(s) for s in stub["settled"]] == [(r["message_id"], r["attempt"], r["action"], r["kind"],
                                                     r["delay_ms"], r["reason"]) for r in project.records(via="stub")]
    assert stub["pending"] == 0

    # The five scenarios, spelled out (the same for both, as just asserted).
    actions = {message_id: [(d[0], d[1], d[2], d[3]) for d in steps] for message_id, steps in by_worker.items()}
    assert actions == {
        "retry-then-succeed": [(1, "retry", "failed", 200), (2, "retry", "failed", 400), (3, "ack", "ok", 0)],
        "poisonous": [(1, "archive", "archive", 0)],
        "retry-with-delay": [(1, "retry", "retry", 300), (2, "ack", "ok", 0)],
        "max-retries-exhausted": [(1, "retry", "failed", 200), (2, "retry", "failed", 400),
                                  (3, "archive", "failed", 0)],
        "undecodable": [(1, "archive", "undecodable", 0)],
    }
    reasons = {message_id: steps[-1][6] for message_id, steps in by_worker.items() if steps[-1][1] == "archive"}
    assert reasons["poisonous"].startswith("poisonous section failed: ValueError: invalid literal for int()")
    assert reasons["max-retries-exhausted"] == ("gave up after 3 attempts (max_retries=2): "
                                                "builtins.RuntimeError: always fails")
    assert reasons["undecodable"].startswith("body is not valid JSON in utf-8")

    # The archive: the same messages, with the same failure headers.
    def archived(message_id: str, body: bytes, headers: dict) -> tuple:
        keyed = bool(re.fullmatch(r"[0-9a-f]{20}", str(headers.get(wire.ARCHIVE_KEY))))  # each copy its own
        return message_id, body, keyed, {k: str(headers.get(k)) for k in COMPARED}

    real = sorted(archived(m.properties["message_id"], bytes(m.body), m.headers) for m in archive)
    kit = sorted(archived(message_id, bytes.fromhex(body), headers) for message_id, body, headers in stub["archived"])
    assert real == kit
    assert [(m, keyed) for m, _b, keyed, _h in real] == [
        ("max-retries-exhausted", True), ("poisonous", True), ("undecodable", True)]

