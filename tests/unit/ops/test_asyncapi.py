"""The AsyncAPI document of a service (ops/asyncapi.py, ``kombu-events asyncapi``) without a broker: every kind of
handler and a publication, no credential anywhere, every ``$ref`` resolving, the same text for the same service,
pydantic's JSON Schema 2020-12 rewritten to AsyncAPI's draft-07 format, and the YAML reading back as the JSON.
tests/integration/test_asyncapi.py runs the command and validates its output with the reference parser."""
from __future__ import annotations

import dataclasses
import json
import os
import sys
import textwrap
import uuid
from typing import Annotated, Any, Literal, Optional, Union

import celery
import pytest
import yaml
from click.testing import CliRunner
from hypothesis import given, strategies as st
from pydantic import BaseModel, Field
from typing_extensions import TypedDict

from kombu_events import Constant, Event, Events, Exponential
from kombu_events.cli import cli
from kombu_events.cli.common import ERROR, OK
from kombu_events.errors import ConfigurationError
from kombu_events.ops.asyncapi import document, render
from kombu_events.ops.json_schema import draft07
from kombu_events.ops.yaml_text import to_json, to_yaml

PASSWORD, USER = "pw-0a9f3c", "user-5e1d"
URL = f"amqp://{USER}:{PASSWORD}@rabbit.example.com:5672/shop"


class Line(BaseModel):
    sku: str
    qty: int = Field(1, description="how many")


class Card(BaseModel):
    kind: Literal["card"]
    last4: str


class Cash(BaseModel):
    kind: Literal["cash"]


class OrderCreated(BaseModel):
    """An order was placed."""

    order_id: int
    lines: list[Line]
    first: Line = Field(description="the first line")
    pair: tuple[int, str]
    # pydantic evaluates these on Python 3.9 too, which has no X | Y
    payment: Annotated[Union[Card, Cash], Field(discriminator="kind")]  # noqa: UP007
    parent: Optional[OrderCreated] = None  # noqa: UP045


@dataclasses.dataclass
class Refund:
    order_id: int
    amount_cents: int


class Shipped(TypedDict):
    order_id: int
    carrier: str


def charge(order: OrderCreated) -> None:
    """Charge the customer for a new order.

    Only the first line is the summary.
    """


def refund(payload: Refund) -> None:
    """Refund an order."""


def shipped(payload: Shipped) -> None:
    pass


def audit(payload):
    """Log every event."""


def invoice_paid(event: Event[Refund]) -> None:
    """Mark the invoice paid."""


def raw(body):
    """Keep the bytes."""


def tick(event):
    pass


def make_service(*, order: int = 1, url: str = URL, **settings: Any) -> Events:
    """The service of every handler kind; ``order=-1`` registers everything the other way round."""
    app = celery.Celery("billing", broker=url, set_as_current=False)
    events = Events(app, service="billing", max_retries=3, delay_levels=8, **settings)
    registrations = [
        lambda: events.handler("orders.*.created")(charge),
        lambda: events.handler("refunds.#", backoff=Constant(every_ms=5000), max_retries=10)(refund),
        lambda: events.handler("orders.*.shipped", "shipments.#")(shipped),
        lambda: events.handler("audit.#")(audit),
        lambda: events.handler(type="com.example.invoice.paid", bind=True, max_retries=0)(invoice_paid),
        lambda: events.handler("raw.#", raw=True)(raw),
        lambda: events.periodic("tick", every=3600)(tick),
        lambda: events.publishes("billing.invoice.*", Refund),
        lambda: events.publishes("billing.#", Shipped),
    ]
    for register in registrations[::order]:
        register()
    return events


@pytest.fixture(autouse=True)
def _no_rabbit_url(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RABBIT_URL", raising=False)


@pytest.fixture
def doc() -> dict[str, Any]:
    return document(make_service())


def test_the_document_is_asyncapi_3_of_the_service(doc):
    assert doc["asyncapi"] == "3.0.0" and doc["defaultContentType"] == "application/json"
    assert (doc["info"]["title"], doc["info"]["version"]) == ("billing", "1.0.0")
    assert "1.0.0" in doc["info"]["description"] and "periodic schedules" in doc["info"]["description"]
    assert document(make_service(), version="2.1.0")["info"]["version"] == "2.1.0"


def test_the_events_exchange_is_one_routing_key_channel_with_the_publications(doc):
    channel = doc["channels"]["events-exchange"]
    assert channel["address"] is None
    assert channel["bindings"]["amqp"] == {"is": "routingKey", "bindingVersion": "0.3.0", "exchange": {
        "name": "events", "type": "topic", "durable": True, "autoDelete": False, "vhost": "shop"}}
    assert sorted(channel["messages"]) == ["publish.billing.hash", "publish.billing.invoice.star"]


def test_each_handler_queue_is_a_queue_channel_and_schedules_are_left_out(doc):
    assert sorted(doc["channels"]) == ["billing.audit", "billing.charge", "billing.invoice_paid", "billing.raw",
                                       "billing.refund", "billing.shipped", "events-exchange"]
    assert not any("schedule" in key or "tick" in key for key in [*doc["operations"], *doc["components"]["messages"]])
    channel = doc["channels"]["billing.shipped"]
    assert channel["address"] == "billing.shipped"
    assert channel["bindings"]["amqp"] == {"is": "queue", "bindingVersion": "0.3.0", "queue": {
        "name": "billing.shipped", "durable": True, "exclusive": False, "autoDelete": False, "vhost": "shop"}}
    assert channel["x-kombu-events-bindings"] == [{"exchange": "events", "routingKey": "orders.*.shipped"},
                                                  {"exchange": "events", "routingKey": "shipments.#"}]
    assert channel["x-kombu-events-arguments"]["x-dead-letter-exchange"] == "billing.delay.0"
    assert doc["channels"]["billing.invoice_paid"]["x-kombu-events-bindings"] == [
        {"exchange": "events", "routingKey": "#"}]  # type= alone binds "#": the type picks the events


def test_a_queue_name_with_braces_is_no_address():
    app = celery.Celery("x", broker=URL, set_as_current=False)
    events = Events(app, service="x")
    events.handler("a.b", queue="x.{odd}")(audit)
    channel = document(events)["channels"]["x._odd_"]
    assert channel["address"] is None and channel["bindings"]["amqp"]["queue"]["name"] == "x.{odd}"


def test_a_receive_operation_per_handler_with_its_retries_and_the_archive(doc):
    charge_op = doc["operations"]["charge"]
    assert charge_op["action"] == "receive" and charge_op["channel"] == {"$ref": "#/channels/billing.charge"}
    assert charge_op["messages"] == [{"$ref": f"#/channels/billing.charge/messages/{m}"}
                                     for m in ("charge", "charge.cloudevents", "charge.cloudevents-binary")]
    assert charge_op["summary"] == "Charge the customer for a new order."
    assert charge_op["bindings"]["amqp"] == {"ack": True, "bindingVersion": "0.3.0"}
    assert charge_op["x-kombu-events-handler"] == f"{__name__}.charge"
    retry = charge_op["x-kombu-events-retry"]
    assert (retry["maxRetries"], retry["delaysMs"], retry["backoff"]["policy"]) == (3, [1000, 2000, 4000],
                                                                                    "Exponential")
    archive = charge_op["x-kombu-events-archive"]
    assert (archive["queue"], archive["type"], archive["maxBytes"], archive["maxAgeMs"]) == (
        "billing.archive", "stream", 1024**3, 7 * 24 * 3600 * 1000)
    assert archive["archivedAtOnce"][0] == "a payload that does not fit OrderCreated"
    text = charge_op["description"]
    assert "retried up to 3 times, after 1 s, 2 s, 4 s" in text
    assert "stream `billing.archive` (each kept 7 d and at most 1 GiB in all)" in text
    assert "a payload that does not fit OrderCreated" in text
    assert doc["operations"]["shipped"]["summary"] == "Handles the events bound with orders.*.shipped, shipments.#."
    assert not any("fit" in reason for reason in doc["operations"]["audit"]["x-kombu-events-archive"]["archivedAtOnce"])


def test_the_ladder_holds_whole_units_and_a_constant_policy_repeats(doc):
    refund_retry = doc["operations"]["refund"]["x-kombu-events-retry"]
    assert (refund_retry["delaysMs"], refund_retry["backoff"]) == ([5000], {"policy": "Constant", "everyMs": 5000})
    assert "after 5 s, then 5 s for each further retry" in doc["operations"]["refund"]["description"]
    assert "not retried" in doc["operations"]["invoice_paid"]["description"]
    events = make_service(backoff=Exponential(base_ms=1500, factor=2, max_delay_ms=5000, jitter=0.25))
    op = document(events)["operations"]["charge"]
    assert op["x-kombu-events-retry"]["delaysMs"] == [2000, 3000, 5000]  # 1.5 s rounded up to whole seconds
    assert "(each drawn from 0.75-1 times that: jitter 0.25)" in op["description"]


def test_a_type_handler_says_its_message_type(doc):
    op = doc["operations"]["invoice_paid"]
    assert op["x-kombu-events-message-type"] == "com.example.invoice.paid"
    assert "Only events of message type `com.example.invoice.paid`" in op["description"]
    message = doc["components"]["messages"]["invoice_paid"]
    assert message["bindings"]["amqp"]["messageType"] == "com.example.invoice.paid"
    assert message["payload"] == {"$ref": "#/components/schemas/Refund"}  # Event[Refund]: the payload's type
    assert doc["operations"]["charge"]["x-kombu-events-message-type"] is None


def test_a_send_operation_per_publication_on_the_exchange_channel(doc):
    op = doc["operations"]["publish.billing.invoice.star"]
    assert op["action"] == "send" and op["channel"] == {"$ref": "#/channels/events-exchange"}
    assert op["messages"] == [{"$ref": "#/channels/events-exchange/messages/publish.billing.invoice.star"}]
    assert op["x-kombu-events-routing-key"] == "billing.invoice.*"
    assert op["bindings"]["amqp"] == {"deliveryMode": 2, "bindingVersion": "0.3.0"}
    assert doc["components"]["messages"]["publish.billing.hash"]["payload"] == {"$ref": "#/components/schemas/Shipped"}


def test_payloads_are_the_contracts_schemas_with_their_defs_in_components(doc):
    messages, schemas = doc["components"]["messages"], doc["components"]["schemas"]
    assert messages["charge"]["payload"] == {"$ref": "#/components/schemas/OrderCreated"}
    assert messages["refund"]["payload"] == {"$ref": "#/components/schemas/Refund"}  # a dataclass
    assert messages["shipped"]["payload"] == {"$ref": "#/components/schemas/Shipped"}  # a TypedDict
    assert sorted(schemas) == ["Card", "Cash", "Line", "OrderCreated", "Refund", "Shipped"]
    order = schemas["OrderCreated"]["properties"]
    assert order["lines"]["items"] == {"$ref": "#/components/schemas/Line"}
    assert order["parent"]["anyOf"][0] == {"$ref": "#/components/schemas/OrderCreated"}  # recursive
    assert schemas["Shipped"]["required"] == ["order_id", "carrier"]
    assert messages["audit"]["payload"] == {
        "description": "Any JSON: the handler's parameter has no type, nothing is checked."}
    assert "payload" not in messages["raw"] and "contentType" not in messages["raw"]
    assert all(m.get("contentType", "application/json") == "application/json" for key, m in messages.items()
               if not key.endswith(".cloudevents"))
    assert {m["contentType"] for key, m in messages.items() if key.endswith(".cloudevents")} == {
        "application/cloudevents+json"}
    assert not any(key.startswith("raw.") for key in messages), "raw=True unwraps nothing: the bare form only"


def refs(node: Any):
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "$ref":
                yield value
            else:
                yield from refs(value)
    elif isinstance(node, list):
        for value in node:
            yield from refs(value)


def resolve(doc: dict[str, Any], ref: str) -> Any:
    assert ref.startswith("#/"), ref
    node: Any = doc
    for part in ref[2:].split("/"):
        part = part.replace("~1", "/").replace("~0", "~")
        assert isinstance(node, dict) and part in node, f"{ref} does not resolve"
        node = node[part]
    return node


def test_every_ref_resolves_and_no_defs_are_left(doc):
    found = list(refs(doc))
    assert len(found) > 30
    for ref in found:
        resolve(doc, ref)
    text = to_json(doc)
    assert "$defs" not in text and "prefixItems" not in text and '"discriminator"' not in text
    for op in doc["operations"].values():  # an operation's messages are its channel's
        channel = resolve(doc, op["channel"]["$ref"])
        for message in op["messages"]:
            assert message["$ref"].startswith(op["channel"]["$ref"] + "/messages/")
            assert resolve(doc, message["$ref"]) in channel["messages"].values()


@pytest.mark.parametrize("fmt", ["json", "yaml"])
def test_no_password_and_no_user_name_anywhere(fmt):
    text = render(document(make_service()), fmt)
    assert PASSWORD not in text and USER not in text
    assert (text.count("rabbit.example.com:5672"), text.count("securitySchemes/user-password")) == (1, 1)


def test_the_servers_are_the_broker_urls_without_credentials():
    def servers(url: str) -> dict[str, Any]:
        return document(make_service(), broker_url=url)["servers"]

    [one] = servers(URL).values()
    assert (one["host"], one["protocol"], one["protocolVersion"], one["pathname"]) == (
        "rabbit.example.com:5672", "amqp", "0.9.1", "/shop")
    assert servers("amqp://guest:guest@localhost//")["rabbitmq"]["pathname"] == "/%2F"  # vhost "/"
    tls = servers(f"amqps://{USER}:{PASSWORD}@a.example.com/x;amqps://b.example.com:6000/x")
    assert [(s["host"], s["protocol"]) for s in tls.values()] == [("a.example.com:5671", "amqps"),
                                                                  ("b.example.com:6000", "amqps")]
    assert list(tls) == ["rabbitmq", "rabbitmq_2"] and PASSWORD not in json.dumps(tls)
    assert servers("amqp://[::1]:5672//")["rabbitmq"]["host"] == "[::1]:5672"


def test_the_same_service_gives_the_same_text_whatever_the_order_of_registration():
    first, second = make_service(), make_service(order=-1)
    assert [h.name for h in first.handlers] != [h.name for h in second.handlers]
    for fmt in ("json", "yaml"):
        assert render(document(first), fmt) == render(document(second), fmt) == render(document(first), fmt)


def test_two_schemas_of_one_name_get_two_keys_and_one_schema_is_shared():
    def other_line() -> type[BaseModel]:
        class Line(BaseModel):  # same name, other fields
            code: str

        class Return(BaseModel):
            line: Line

        return Return

    app = celery.Celery("x", broker=URL, set_as_current=False)
    events = Events(app, service="x")
    events.publishes("a.#", OrderCreated)
    events.publishes("b.#", other_line())
    events.publishes("c.#", list[Line])
    doc = document(events)
    schemas = doc["components"]["schemas"]
    assert schemas["Line"]["properties"]["sku"] and schemas["Line_2"]["properties"] == {
        "code": {"title": "Code", "type": "string"}}
    assert schemas["Return"]["properties"]["line"] == {"$ref": "#/components/schemas/Line_2"}
    assert schemas["list_Line_"] == {"items": {"$ref": "#/components/schemas/Line"}, "type": "array"}
    for ref in refs(doc):
        resolve(doc, ref)


def test_a_contract_without_a_json_schema_is_a_clear_error():
    app = celery.Celery("x", broker=URL, set_as_current=False)
    events = Events(app, service="x")
    events.publishes("a.#", Annotated[Any, "opaque"])
    events.publishes("b.#", Union[int, str])
    document(events)  # fine: both have a schema

    class Weird:
        @classmethod
        def __get_pydantic_core_schema__(cls, source: Any, handler: Any) -> Any:
            from pydantic_core import core_schema

            return core_schema.is_instance_schema(cls)

    events.publishes("c.#", Weird)
    with pytest.raises(ConfigurationError, match=r"^publication 'c\.#': cannot describe .*Weird as JSON Schema: "
                                                 r"Cannot generate a JsonSchema for core_schema\.IsInstanceSchema "
                                                 r".*Weird'>\)$"):
        document(events)


# -- draft07: pydantic's 2020-12 as AsyncAPI's draft-07 format ----------------------------------------------------

def test_draft07_rewrites_refs_tuples_ref_siblings_and_discriminators():
    names = {"A": "A", "B": "B_2"}
    schema = {
        "type": "object",
        "properties": {
            "a": {"$ref": "#/$defs/A", "description": "with a sibling"},
            "pair": {"type": "array", "prefixItems": [{"type": "integer"}, {"$ref": "#/$defs/B"}],
                     "items": {"type": "string"}},
            "either": {"oneOf": [{"$ref": "#/$defs/A"}, {"$ref": "#/$defs/B"}],
                       "discriminator": {"propertyName": "kind", "mapping": {"a": "#/$defs/A", "b": "#/$defs/B"}}},
            # property names and data are not keywords
            "$ref": {"type": "string", "default": {"$ref": "#/$defs/A"}, "examples": [{"prefixItems": 1}]},
            "discriminator": {"type": "string", "const": "#/$defs/A"},
        },
    }
    out = draft07(schema, names)
    props = out["properties"]
    assert props["a"] == {"description": "with a sibling", "allOf": [{"$ref": "#/components/schemas/A"}]}
    assert props["pair"] == {"type": "array", "items": [{"type": "integer"}, {"$ref": "#/components/schemas/B_2"}],
                             "additionalItems": {"type": "string"}}
    assert props["either"]["oneOf"][1] == {"$ref": "#/components/schemas/B_2"}
    assert props["either"]["x-discriminator"] == {
        "propertyName": "kind", "mapping": {"a": "#/components/schemas/A", "b": "#/components/schemas/B_2"}}
    assert "discriminator" not in props["either"]
    assert props["$ref"] == schema["properties"]["$ref"] and props["discriminator"] == schema["properties"][
        "discriminator"]
    assert draft07({"prefixItems": [True], "items": False}, {}) == {"items": [True], "additionalItems": False}
    assert draft07(True, {}) is True


# -- YAML ----------------------------------------------------------------------------------------------------------

def test_the_yaml_reads_back_as_the_json(doc):
    text = to_yaml(doc)
    assert yaml.safe_load(text) == json.loads(to_json(doc)) == doc
    assert text.startswith('asyncapi: "3.0.0"\ninfo:\n  title: billing\n')
    assert "    description: |-\n" in text  # a multi-line description reads as a block


@pytest.mark.parametrize("text", ["", " ", "yes", "No", "null", "~", "1.0", "3.0.0", "0x1F", "-", "- a", "*x", "&a",
                                  "#c", "a #c", "a: b", "a:b", "{x}", "[x]", "'q'", '"q"', "x ", " x", "a\nb", "\n",
                                  "a\n", "\na", "a\n b", "tab\there", "\u2028", "é ü", "\x85", "<<", "=", "@x",
                                  "`x`", "%x", "!x", "a|b", "?", "orders.*.created", "orders.#", "$ref"])
def test_tricky_strings_read_back(text):
    value = {text: [text, {text: text}], "k": text}
    assert yaml.safe_load(to_yaml(value)) == value


@given(st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda children: st.lists(children) | st.dictionaries(st.text(), children), max_leaves=20))
def test_any_json_value_reads_back_from_its_yaml(value):
    assert yaml.safe_load(to_yaml(value)) == value


def test_render_refuses_an_unknown_format(doc):
    with pytest.raises(ValueError, match="unknown format 'xml'"):
        render(doc, "xml")


# -- the command ---------------------------------------------------------------------------------------------------

APP = f"""
from celery import Celery
from pydantic import BaseModel
from kombu_events import Events

app = Celery("cli", broker={URL!r})
events = Events(app, service="cli")

class Paid(BaseModel):
    id: int

@events.handler("invoices.*.paid")
def paid(payload: Paid) -> None:
    '''Note the payment.'''

events.publishes("invoices.*.sent", Paid)
"""


@pytest.fixture
def app_module(tmp_path, monkeypatch):
    """A Celery app module (unique name) in the current directory, as `-A` finds one."""
    name = f"asyncapi_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(APP))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))  # the group callback puts "." on it
    yield name
    sys.modules.pop(name, None)


def invoke(*args: str):
    try:
        runner = CliRunner(mix_stderr=False)  # type: ignore[call-arg]
    except TypeError:  # click >= 8.2: always apart
        runner = CliRunner()
    return runner.invoke(cli, list(args), prog_name="kombu-events")


def test_the_command_prints_yaml_or_json_or_writes_a_file(app_module, tmp_path):
    printed = invoke("-A", app_module, "asyncapi")
    assert printed.exit_code == OK, printed.output
    doc = yaml.safe_load(printed.stdout)
    assert doc["operations"]["paid"]["summary"] == "Note the payment."
    assert json.loads(invoke("-A", app_module, "asyncapi", "--format", "json").stdout) == doc
    out = tmp_path / "asyncapi.json"
    written = invoke("-A", app_module, "asyncapi", "--format", "json", "--output", str(out), "--api-version", "2.0.0")
    assert (written.exit_code, written.stdout) == (OK, "")
    assert json.loads(out.read_text())["info"]["version"] == "2.0.0"
    other = invoke("-A", app_module, "--broker", "amqp://u:other-secret@elsewhere:5673/v", "asyncapi")
    assert "elsewhere:5673" in other.stdout and "other-secret" not in other.stdout and PASSWORD not in other.stdout


def test_the_command_fails_in_one_line_with_exit_1(app_module, tmp_path):
    unknown = invoke("-A", app_module, "asyncapi", "--format", "xml")
    assert unknown.exit_code == ERROR and "'xml' is not one of 'yaml', 'json'" in unknown.stderr
    unwritable = invoke("-A", app_module, "asyncapi", "--output", str(tmp_path / "no" / "such" / "dir.yaml"))
    assert unwritable.exit_code == ERROR and unwritable.stdout == ""
    target = tmp_path / "no" / "such" / "dir.yaml"
    assert unwritable.stderr.strip().splitlines() == [
        f"Error: cannot write the AsyncAPI document to {target}: No such file or directory"]
    assert invoke("asyncapi").exit_code == ERROR  # no -A


# -- the documentation page (docs/_tools/asyncapi_page.py) ---------------------------------------------------------

def test_the_docs_page_shows_the_tutorial_service_as_tables_and_yaml(tmp_path, monkeypatch):
    import importlib.util
    from pathlib import Path

    monkeypatch.setenv("RABBIT_URL", f"amqp://{USER}:{PASSWORD}@elsewhere//")  # left out: the page is the same
    path = Path(__file__).resolve().parents[3] / "docs" / "_tools" / "asyncapi_page.py"
    spec = importlib.util.spec_from_file_location("asyncapi_page", path)
    assert spec is not None and spec.loader is not None
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    page = tool.write(tmp_path / "reference")
    text = page.read_text()
    assert page.name == "asyncapi.md" and text.startswith("# The AsyncAPI document of `shop`\n")
    assert "generated when the documentation is built: `kombu-events -A shop asyncapi`" in text
    assert "| `send_receipt` | receive | `shop.send_receipt` | any JSON | 2, after 1 s, 2 s |" in text
    assert f"]({Path(os.path.relpath(tool.DOCS / 'tutorial.md', tmp_path / 'reference')).as_posix()})" in text
    listing = text.split("```yaml\n", 1)[1].split("\n```\n", 1)[0]
    doc = yaml.safe_load(listing)
    assert doc["info"]["title"] == "shop" and doc["servers"]["rabbitmq"]["host"] == "127.0.0.1:5672"
    assert PASSWORD not in text and "elsewhere" not in text
