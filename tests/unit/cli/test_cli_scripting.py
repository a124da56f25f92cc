"""The CLI made for scripts, without a broker: ``--version``, a ``--json`` option and a JSON Schema for every
command that reports or changes something, the exit codes (a usage error exits 1: 2 is "over a threshold"),
``publish --message-id/--header`` parsing, and the JSON of the commands that need no broker validated
against their schemas. tests/integration/test_cli_json.py validates the others' on the real broker."""
from __future__ import annotations

import configparser
import json
import sys
import textwrap
import uuid
from pathlib import Path
from typing import Any

import click
import pytest
from click.testing import CliRunner
from jsonschema import Draft202012Validator

import kombu_events
from kombu_events.cli import cli
from kombu_events.cli.common import ERROR, OK, OVER_THRESHOLD, schema, schema_names
from kombu_events.cli.publish import HeaderType
from kombu_events.publishing.backlog import Backlog
from kombu_events.publishing.publisher import build_message

from .test_cli_help import COMMANDS

ROOT = Path(__file__).resolve().parents[3]

#: Each command that reports or changes something, and the schema(s) of its --json document.
SCHEMAS = {
    ("declare",): ["declare", "declare-dry-run"],
    ("migrate",): ["migrate"],
    ("status",): ["status"],
    ("health",): ["health"],
    ("schedules",): ["schedules"],
    ("archive", "list"): ["archive-list"],
    ("archive", "show"): ["archive-show"],
    ("archive", "replay"): ["archive-replay"],
    ("archive", "purge"): ["archive-purge"],
    ("archive", "rewrite"): ["archive-rewrite"],
    ("publish",): ["publish"],
    ("backlog", "status"): ["backlog-status"],
    ("backlog", "flush"): ["backlog-flush"],
    ("permissions",): ["permissions"],
    ("outbox", "status"): ["outbox-status"],
    ("outbox", "relay"): ["outbox-relay"],
    ("outbox", "create-tables"): ["outbox-create-tables"],
    ("log", "status"): ["log-status"],
    ("log", "rewind"): ["log-rewind"],
}

#: Commands whose output is a document of a standard of its own, not a kombu-events report: no --json.
STANDARD_DOCUMENTS = {("asyncapi",): "an AsyncAPI 3.0 document, --format json or yaml"}
#: Commands that serve rather than report: no --json (the console's JSON API uses the archive schemas).
SERVERS = {("console",): "the failed-message console"}
LEAVES = {path: command for path, command in COMMANDS.items()
          if not isinstance(command, click.Group) and path not in STANDARD_DOCUMENTS and path not in SERVERS}


def invoke(*args: str):
    """Run the CLI; ``.stdout`` and ``.stderr`` apart (click 8.1, on Python 3.9, mixes them unless told)."""
    try:
        runner = CliRunner(mix_stderr=False)  # type: ignore[call-arg]
    except TypeError:  # click >= 8.2: always apart
        runner = CliRunner()
    return runner.invoke(cli, list(args), prog_name="kombu-events")


def assert_valid(name: str, document: Any) -> None:
    errors = sorted(Draft202012Validator(schema(name)).iter_errors(document), key=str)
    assert not errors, f"{name}.json: " + "; ".join(f"{list(e.absolute_path)}: {e.message}" for e in errors)


# -- --version ---------------------------------------------------------------------------------------

def test_version_prints_the_package_version_and_needs_no_app():
    result = invoke("--version")
    assert result.exit_code == OK
    assert result.stdout == f"kombu-events {kombu_events.__version__}\n"
    assert f'__version__ = "{kombu_events.__version__}"' in (ROOT / "kombu_events" / "version.py").read_text()
    assert "--version" in invoke("--help").stdout


# -- --json and its schemas -----------------------------------------------------------------------------

def test_every_command_that_reports_or_changes_something_has_json_and_a_schema():
    assert set(LEAVES) == set(SCHEMAS), "a new command: give it --json and a schema (docs/cli.md)"
    assert sorted(n for names in SCHEMAS.values() for n in names) == schema_names(), "a schema no command uses"
    for path, command in LEAVES.items():
        [option] = [p for p in command.params if "--json" in getattr(p, "opts", ())]
        assert option.is_flag and option.name == "as_json", path
        for name in SCHEMAS[path]:
            assert f"kombu_events/cli/schemas/{name}.json" in (option.help or ""), (path, option.help)


@pytest.mark.parametrize("name", schema_names())
def test_every_schema_is_a_valid_json_schema_with_a_title_and_a_description(name):
    found = schema(name)
    Draft202012Validator.check_schema(found)
    assert found["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    assert found["title"].startswith("kombu-events ") and found["description"]
    text = (ROOT / "kombu_events" / "cli" / "schemas" / f"{name}.json").read_text()
    assert text == json.dumps(found, indent=2) + "\n", "schemas are stored as json.dumps(indent=2) writes them"


def test_the_shared_parts_of_the_schemas_agree():
    assert schema("health")["$defs"]["queue"] == schema("status")["$defs"]["queue"]
    assert schema("archive-list")["properties"] == schema("archive-show")["properties"]
    replayed = schema("archive-replay")["properties"]["messages"]["items"]["properties"]
    purged = schema("archive-purge")["properties"]["messages"]["items"]["properties"]
    assert {k: v for k, v in replayed.items() if k != "outcome"} == {k: v for k, v in purged.items() if k != "outcome"}


def test_every_object_of_every_schema_lists_its_keys_as_required_and_no_others():
    """Stable keys: every key is always there (null when it does not apply), and a new key needs the schema."""
    def objects(node: Any):
        if isinstance(node, dict):
            if node.get("type") == "object" and "properties" in node:
                yield node
            for value in node.values():
                yield from objects(value)
        elif isinstance(node, list):
            for value in node:
                yield from objects(value)

    for name in schema_names():
        for node in objects(schema(name)):
            assert node["additionalProperties"] is False, (name, sorted(node["properties"]))
            assert sorted(node["required"]) == sorted(node["properties"]), name


def test_the_schemas_are_package_data():
    """setup.cfg ships them in the wheel and the sdist (scripts/check-dist runs these tests on the wheel)."""
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    assert "cli/schemas/*.json" in config["options.package_data"]["kombu_events"]


# -- exit codes -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("args", [
    ["status", "--no-such-option"],
    ["no-such-command"],
    ["archive", "show"],  # its MESSAGE_ID is missing
    ["archive", "purge"],  # neither --yes nor --dry-run
    ["declare", "--format", "dot"],  # without --dry-run
    ["declare", "--dry-run", "--format", "dot", "--json"],
    ["archive", "list", "--limit", "0"],
    ["declare", "--dry-run"],  # no -A
], ids=" ".join)
def test_a_usage_error_exits_1_with_clicks_message_on_stderr(args):
    result = invoke(*args)
    assert result.exit_code == ERROR, result.output
    assert result.stdout == ""
    assert "Usage: kombu-events" in result.stderr


def test_the_exit_codes_are_zero_one_two():
    assert (OK, ERROR, OVER_THRESHOLD) == (0, 1, 2)
    assert invoke("--help").exit_code == OK and invoke("archive", "--help").exit_code == OK


# -- publish --message-id / --header -------------------------------------------------------------------

@pytest.mark.parametrize(("text", "parsed"), [
    ("x-tenant=acme", ("x-tenant", "acme")),
    ("x-empty=", ("x-empty", "")),
    ("x-eq=a=b", ("x-eq", "a=b")),
    ("x-colon=a:=b", ("x-colon", "a:=b")),
    ("x-number=3", ("x-number", "3")),  # a string: KEY=VALUE never parses
    ("x-number:=3", ("x-number", 3)),
    ("x-float:=2.5", ("x-float", 2.5)),
    ("x-flag:=true", ("x-flag", True)),
    ("x-none:=null", ("x-none", None)),
    ("x-text:=\"3\"", ("x-text", "3")),
    ("x-list:=[1, \"a\", {\"b\": false}]", ("x-list", [1, "a", {"b": False}])),
    ("x-obj:={\"a\": {\"b\": [1]}}", ("x-obj", {"a": {"b": [1]}})),
    ("x-big:=-9223372036854775808", ("x-big", -2**63)),
    ("a:b=c", ("a:b", "c")),
])
def test_a_header_is_a_string_or_json(text, parsed):
    assert HeaderType().convert(text, None, None) == parsed


@pytest.mark.parametrize(("text", "why"), [
    ("no-equals-sign", "is not KEY=VALUE"),
    ("=value", "no header name"),
    (":=1", "no header name"),
    ("x-n:=nope", "is not JSON"),
    ("x-n:=", "is not JSON"),
    ("x-n:=NaN", "is not JSON"),
    ("x-n:=[Infinity]", "is not JSON"),
    ("x-n:=9223372036854775808", "does not fit in a signed 64-bit integer"),
    ("x-n:={\"a\": [18446744073709551616]}", "does not fit in a signed 64-bit integer"),
    ("kombu-events-attempts=0", "kombu-events' own"),
    ("Kombu-Events-Queue:=1", "kombu-events' own"),
    ("k" * 256 + "=v", "longer than 255 bytes"),
])
def test_a_bad_header_is_one_clear_usage_error_before_connecting(text, why):
    result = invoke("--broker", "amqp://nowhere:1//", "publish", "--header", text, "orders.1.created", "{}")
    assert result.exit_code == ERROR, result.output
    assert "Invalid value for '--header'" in result.stderr and why in result.stderr, result.stderr
    assert "Traceback" not in result.output


@pytest.mark.parametrize(("args", "why"), [
    (["--header", "x-a=1", "--header", "x-a:=2"], "header 'x-a' given twice"),
    (["--message-id", ""], "must not be empty"),
    (["--message-id", "m" * 256], "at most 255 bytes"),
])
def test_duplicate_headers_and_bad_message_ids_are_usage_errors(args, why):
    result = invoke("--broker", "amqp://nowhere:1//", "publish", *args, "orders.1.created", "{}")
    assert result.exit_code == ERROR and why in result.stderr, result.output


def test_publish_help_documents_both_header_forms():
    text = invoke("publish", "--help").stdout
    assert "--message-id TEXT" in text and "--header KEY=VALUE|KEY:=JSON" in text
    assert "KEY=VALUE sets a string, KEY:=JSON any JSON value (repeatable)" in " ".join(text.split())


# -- the JSON of the commands that need no broker ------------------------------------------------------

APP = """
from celery import Celery
from kombu_events import Events

app = Celery("scripting", broker="amqp://guest:guest@127.0.0.1:1//")
events = Events(app, service="scripting", exchange="scripting-events", queue_type="quorum", delay_levels=3)

@events.handler("orders.#", "refunds.*.paid")
def orders(payload):
    pass

@events.periodic("tick", every=60)
def tick(event):
    pass
"""


@pytest.fixture
def app_module(tmp_path, monkeypatch):
    """A Celery app module (unique name) in the current directory, as `-A` finds one."""
    name = f"scripting_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(APP))
    monkeypatch.chdir(tmp_path)
    yield name
    sys.modules.pop(name, None)


def test_declare_dry_run_json_is_the_text_plan_as_one_document(app_module):
    result = invoke("-A", app_module, "declare", "--dry-run", "--json")
    assert result.exit_code == OK, result.output
    document = json.loads(result.stdout)
    assert_valid("declare-dry-run", document)
    assert (document["service"], document["exchange"], document["queue_type"]) == (
        "scripting", "scripting-events", "quorum")
    plan = invoke("-A", app_module, "declare", "--dry-run").stdout.splitlines()
    assert [f"exchange {e['name']} type={e['type']} durable={e['durable']}" for e in document["exchanges"]] == [
        line for line in plan if line.startswith("exchange ")]
    as_lines = []
    for q in document["queues"]:
        args = " ".join(f"{k}={v}" for k, v in q["arguments"].items())
        as_lines.append(f"queue {q['name']} durable={q['durable']} {args}".rstrip())
        as_lines += [f"  bind queue {q['name']} <- exchange {b['exchange']} key={b['routing_key']!r}"
                     for b in q["bindings"]]
    as_lines += [f"bind exchange {b['destination']} <- exchange {b['source']} key={b['routing_key']!r}"
                 for b in document["exchange_bindings"]]
    assert as_lines == [line for line in plan if not line.startswith("exchange ")]
    roles = {q["name"]: q["role"] for q in document["queues"]}
    assert roles["scripting.orders"] == "handler" and roles["scripting.archive"] == "archive"
    assert {"delay", "deferred", "unrouted", "schedule", "state"} <= set(roles.values())
    orders = next(q for q in document["queues"] if q["name"] == "scripting.orders")
    assert orders["arguments"]["x-queue-type"] == "quorum"
    assert {"exchange": "scripting-events", "routing_key": "refunds.*.paid"} in orders["bindings"]
    due = next(e for e in document["exchanges"] if e["name"] == "scripting-events.deferred")
    assert due["arguments"] == {"alternate-exchange": "scripting-events.unrouted"}


def test_backlog_status_json_validates_and_stays_json_over_a_threshold(tmp_path):
    backlog = Backlog(tmp_path / "b.sqlite3")
    backlog.store([("events", "a.b", build_message({}, message_id=f"m-{n}")) for n in range(3)], now=0.0)
    result = invoke("backlog", "status", "--path", backlog.path, "--json")
    assert result.exit_code == OK, result.output
    document = json.loads(result.stdout)
    assert_valid("backlog-status", document)
    assert (document["path"], document["depth"], document["rejected"]) == (backlog.path, 3, 0)
    over = invoke("backlog", "status", "--path", backlog.path, "--json", "--max-depth", "2")
    assert over.exit_code == OVER_THRESHOLD
    assert json.loads(over.stdout)["depth"] == 3, "the document is printed all the same"
    assert over.stderr == "ALERT: backlog: 3 events wait (more than --max-depth 2)\n"
    empty = Backlog(tmp_path / "empty.sqlite3")
    empty.check()
    document = json.loads(invoke("backlog", "status", "--path", empty.path, "--json").stdout)
    assert_valid("backlog-status", document)
    assert document["oldest_age_s"] is None and document["depth"] == 0


# -- docs/cli.md ------------------------------------------------------------------------------------------

PAGE = ROOT / "docs" / "cli.md"


def section(path: tuple[str, ...]) -> str:
    """The part of docs/cli.md about one command: from its heading to the next."""
    text = PAGE.read_text()
    start = text.index(f"\n### `{' '.join(path)}`\n")
    end = text.find("\n### ", start + 1)
    return text[start:end if end != -1 else len(text)]


def property_names(node: dict[str, Any]) -> set[str]:
    """The name of every property of a schema, at any depth (``properties``, ``items``, ``$defs``)."""
    found = set(node.get("properties", {}))
    below = [*node.get("properties", {}).values(), *node.get("$defs", {}).values()]
    if isinstance(node.get("items"), dict):
        below.append(node["items"])
    for sub in below:
        found |= property_names(sub)
    return found


@pytest.mark.parametrize("path", sorted(SCHEMAS), ids=" ".join)
def test_docs_cli_describes_every_option_and_every_json_key_of_every_command(path):
    text = section(path)
    for param in LEAVES[path].params:
        for opt in getattr(param, "opts", ()):
            if opt.startswith("--") and opt != "--help":
                assert f"`{opt}" in text, f"docs/cli.md, {' '.join(path)}: {opt}"
    if path == ("archive", "show"):  # the keys of archive list's, which the page lists there
        text += section(("archive", "list"))
    if path == ("health",):  # its queues are status's
        text += section(("status",))
    for name in SCHEMAS[path]:
        for key in property_names(schema(name)):
            assert f"`{key}`" in text, f"docs/cli.md, {' '.join(path)}: the JSON key {key!r} of {name}.json"
        assert f"[{name}.json](../kombu_events/cli/schemas/{name}.json)" in PAGE.read_text()


def test_docs_cli_has_the_exit_codes_table():
    text = PAGE.read_text()
    rows = [line for line in text.split("### Exit codes", 1)[1].splitlines() if line.startswith("| `")]
    assert [row.split("|")[1].strip() for row in rows[:3]] == ["`0`", "`1`", "`2`"]
    assert "a usage error" in text.lower()


def test_schedules_json_rows_have_every_key_the_summary_can_have():
    """A key core.schedule.summary() gains must reach SCHEDULE_KEYS (and the schema), not vanish from --json."""
    from kombu_events.cli.inspect import SCHEDULE_KEYS
    from kombu_events.core.schedule import State, make_schedule, summary

    tick = make_schedule("svc", "tick", every=60)
    ran = State(last_run=5, last_due_ms=300_000, next=6, signature={"changed": 1},
                info={"ran_at": "2026-01-01T00:05:00.000+00:00", "outcome": "ok", "duration_ms": 1.5})
    seen = set(summary(tick, None, 0)) | set(summary(tick, ran, 400_000))
    assert seen <= set(SCHEDULE_KEYS) == set(schema("schedules")["items"]["properties"])
    assert "note" in summary(tick, None, 0) and "outcome" in summary(tick, ran, 400_000)
