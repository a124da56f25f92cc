"""``kombu-events asyncapi`` run as a user runs it, its output validated by the reference AsyncAPI parser
(``@asyncapi/parser``, tests/node/asyncapi_check.js): zero errors for services of every handler kind (a CloudEvents
handler's too: its structured and binary forms, its dedup key, the outbox), as JSON on stdout and as YAML in a file,
and the same bytes from another process. It needs Node.js, not the broker: under
CI=true a missing ``node`` (or parser) fails the test instead of skipping it."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.conftest import CI

from ..brokers import amqp_url
from .harness import NODE_DIR, Project

pytestmark = pytest.mark.integration

PASSWORD = "pw-7c41e0d2"
CHECK = NODE_DIR / "asyncapi_check.js"

#: Every handler kind: a pydantic model (nested, recursive, a tuple, a discriminated union), a dataclass,
#: a TypedDict, none, bind=True, Event[...] with type=, raw=True, a periodic schedule; two publications.
EVERY_KIND = """
import dataclasses
from typing import Annotated, Literal, Optional, Union

from pydantic import BaseModel, Field
from typing_extensions import TypedDict

events = Events(app, service=SERVICE, exchange=EXCHANGE, max_retries=4, delay_levels=6,
                backoff=Exponential(base_ms=500, max_delay_ms=8000, jitter=0.1))

class Line(BaseModel):
    sku: str
    qty: int = Field(1, ge=1, description="how many")

class Card(BaseModel):
    kind: Literal["card"]
    last4: str = Field(pattern=r"^[0-9]{4}$")

class Cash(BaseModel):
    kind: Literal["cash"]

class OrderCreated(BaseModel):
    '''An order was placed.'''
    order_id: int
    lines: list[Line]
    first: Line = Field(description="the first line")
    pair: tuple[int, str]
    payment: Annotated[Union[Card, Cash], Field(discriminator="kind")]
    parent: Optional["OrderCreated"] = None

@dataclasses.dataclass
class Refund:
    order_id: int
    amount_cents: int

class Shipped(TypedDict):
    order_id: int
    carrier: str

@events.handler("orders.*.created")
def charge(order: OrderCreated) -> None:
    '''Charge the customer for a new order.'''

@events.handler("refunds.#", backoff=Constant(every_ms=2000), max_retries=10)
def refund(payload: Refund) -> None:
    '''Refund an order.'''

@events.handler("orders.*.shipped", "shipments.#")
def shipped(payload: Shipped) -> None:
    pass

@events.handler("#")
def audit(payload):
    '''Log every event.'''

@events.handler("orders.#", bind=True, name="audit_orders")
def audit_orders(event):
    pass

@events.handler(type="com.example.invoice.paid", bind=True, max_retries=0)
def invoice_paid(event: Event[Refund]) -> None:
    '''Mark the invoice paid.'''

@events.handler("raw.#", raw=True)
def raw(body):
    '''Keep the bytes.'''

@events.periodic("tick", every=3600)
def tick(event):
    pass

events.publishes("billing.invoice.*", Refund)
events.publishes("billing.orders.#", OrderCreated)
"""

#: The least: one unannotated handler, no publication, quorum queues, an archive without limits.
MINIMAL = """
events = Events(app, service=SERVICE, exchange=EXCHANGE, queue_type="quorum", archive_ttl_ms=0,
                archive_max_length=0)

@events.handler("x.y")
def only(payload):
    pass
"""

#: Publications only (a service that sends and receives nothing), a list and a TypedDict.
PUBLISHER = """
from typing_extensions import TypedDict

events = Events(app, service=SERVICE, exchange=EXCHANGE)

class Tick(TypedDict):
    n: int
    tags: list[str]

events.publishes("clock.*", Tick)
events.publishes("clock.batch", list[Tick])
"""

#: A service fed CloudEvents: a typed handler of one CloudEvents type, effectively once (a database: SQLite in
#: memory, never connected to), its own events published through the outbox. Its channel's messages are the bare
#: form and both CloudEvents modes (application/cloudevents+json with the payload under data; ce-* headers).
CLOUDEVENTS = """
import sqlalchemy as sa
from pydantic import BaseModel

events = Events(app, service=SERVICE, exchange=EXCHANGE, database=sa.create_engine("sqlite://"), outbox=True)

class OrderPlaced(BaseModel):
    order_id: int
    amount: float
    currency: str

@events.handler("orders.*.placed", type="com.example.order.placed", once=True)
def charge(order: OrderPlaced) -> None:
    '''Charge an order, once.'''

events.publishes("orders.*.charged", OrderPlaced)
"""

SERVICES = {"every-kind": EVERY_KIND, "minimal": MINIMAL, "publisher": PUBLISHER, "cloudevents": CLOUDEVENTS}


@pytest.fixture(scope="module")
def node() -> str:
    """The ``node`` executable with the parser installed; skips without them, fails under CI=true."""
    found = shutil.which("node")
    why = None if found else "node is not on PATH"
    if found and not (NODE_DIR / "node_modules" / "@asyncapi" / "parser").is_dir():
        why = "@asyncapi/parser is not installed in tests/node (npm ci --prefix tests/node)"
    if why:
        if CI:
            pytest.fail(why + " (CI=true: the AsyncAPI check must not be skipped)")
        pytest.skip(why)
    assert found is not None
    return found


def project(tmp_path: Path, body: str) -> Project:
    """A service module whose broker URL has a user name and a password (neither may reach the document)."""
    url = f"{amqp_url('asyncapi-user', PASSWORD)};{amqp_url('asyncapi-user', PASSWORD, host='127.0.0.2')}"
    return Project(tmp_path, url, body)


def kombu_events(proj: Project, *args: str, seed: str = "0") -> subprocess.CompletedProcess[str]:
    """``kombu-events -A <module> ARGS`` from the project's directory, as a user runs it."""
    cli = Path(sys.executable).parent / "kombu-events"
    env = {**proj.env(), "PYTHONHASHSEED": seed}
    result = subprocess.run([str(cli), "-A", proj.module, *args], cwd=proj.dir, env=env, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, f"exit {result.returncode}:\n{result.stderr}"
    assert result.stderr == "", result.stderr
    return result


def check(node: str, *, text: str | None = None, path: Path | None = None) -> list[dict[str, object]]:
    """The parser's diagnostics of a document (stdin or a file); the test fails on any error."""
    args = [node, str(CHECK)] + ([str(path)] if path else [])
    result = subprocess.run(args, input=text, cwd=NODE_DIR, capture_output=True, text=True, timeout=120)
    diagnostics = [json.loads(line) for line in result.stdout.splitlines() if line.strip()]
    errors = [d for d in diagnostics if d["severity"] == 0]
    assert result.returncode == 0 and not errors, "\n".join(map(json.dumps, errors)) + result.stderr
    return diagnostics


@pytest.mark.parametrize("name", sorted(SERVICES))
def test_the_document_passes_the_asyncapi_parser_as_json_and_as_yaml(node, tmp_path, name):
    proj = project(tmp_path, SERVICES[name])
    printed = kombu_events(proj, "asyncapi", "--format", "json").stdout
    out = tmp_path / "asyncapi.yaml"
    assert kombu_events(proj, "asyncapi", "--format", "yaml", "--output", str(out)).stdout == ""
    written = out.read_text(encoding="utf-8")
    doc = json.loads(printed)
    assert yaml.safe_load(written) == doc
    assert PASSWORD not in printed + written and "asyncapi-user" not in printed + written
    assert doc["asyncapi"] == "3.0.0" and len(doc["servers"]) == 2

    for diagnostics in (check(node, text=printed), check(node, path=out)):
        # What the parser may still say: only that 3.1.0 exists (the document is 3.0.0 on purpose).
        assert {d["code"] for d in diagnostics} <= {"asyncapi-latest-version"}, diagnostics


def test_a_cloudevents_handlers_document_says_what_arrives_and_passes_the_parser(node, tmp_path):
    """The CloudEvents forms with their content type, ``data`` and ``ce-*`` headers, the type where CloudEvents
    carry it, the dedup key and the outbox's delivery: in a document the reference parser accepts."""
    proj = project(tmp_path, CLOUDEVENTS)
    printed = kombu_events(proj, "asyncapi", "--format", "json").stdout
    assert {d["code"] for d in check(node, text=printed)} <= {"asyncapi-latest-version"}
    doc = json.loads(printed)
    keys = doc["channels"][f"{proj.service}.charge"]["messages"]
    assert list(keys) == ["charge", "charge.cloudevents", "charge.cloudevents-binary"]
    bare, structured, binary = (doc["components"]["messages"][key] for key in keys)
    assert structured["contentType"] == "application/cloudevents+json"
    assert structured["payload"]["properties"]["data"] == {"$ref": "#/components/schemas/OrderPlaced"}
    assert structured["payload"]["properties"]["type"]["const"] == "com.example.order.placed"
    assert binary["headers"]["properties"]["ce-type"]["const"] == "com.example.order.placed"
    assert bare["bindings"]["amqp"]["messageType"] == "com.example.order.placed"
    assert "bindings" not in structured and "bindings" not in binary
    assert doc["operations"]["charge"]["x-kombu-events-once"]["key"] == "message_id"
    [send] = [op for op in doc["operations"].values() if op["action"] == "send"]
    assert send["x-kombu-events-delivery"] == "at-least-once"


def test_every_kind_of_handler_is_in_the_document_and_the_text_is_stable(node, tmp_path):
    proj = project(tmp_path, EVERY_KIND)
    first = kombu_events(proj, "asyncapi", seed="1").stdout
    assert kombu_events(proj, "asyncapi", seed="2").stdout == first  # another hash seed: the same bytes
    doc = yaml.safe_load(first)
    receive = {key for key, op in doc["operations"].items() if op["action"] == "receive"}
    assert receive == {"charge", "refund", "shipped", "audit", "audit_orders", "invoice_paid", "raw"}
    sends = [op["x-kombu-events-routing-key"] for op in doc["operations"].values() if op["action"] == "send"]
    assert sends == ["billing.invoice.*", "billing.orders.#"]
    assert {"Card", "Cash", "Line", "OrderCreated", "Refund", "Shipped"} == set(doc["components"]["schemas"])
    assert "$defs" not in first and "tick" not in json.dumps(doc["operations"])
