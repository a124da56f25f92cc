"""Every command's ``--json``, run as a script runs it against the real broker and a real worker: the whole of
stdout is one JSON document (``archive list``: JSON Lines) that validates against the command's JSON Schema
(kombu_events/cli/schemas/), warnings and alerts go to stderr, and the exit code follows docs/cli.md: 0 fine,
1 an error (then nothing on stdout), 2 over a threshold (the document printed all the same)."""
from __future__ import annotations

import json

import pytest

from kombu_events.publishing.backlog import Backlog
from kombu_events.publishing.publisher import build_message

from .harness import Project, queue_depth, run_cli, wait_for
from .json_schemas import json_lines, one_document

pytestmark = pytest.mark.integration

APP = """
events = Events(app, service=SERVICE, exchange=EXCHANGE, delay_unit_ms=100, delay_levels=2)

@events.handler("orders.#")
def orders(payload):
    record(handler="orders", payload=payload)
    raise Archive("kept for the test")

@events.periodic("tick", every=3600)
def tick(event):
    record(handler="tick")
"""


def cli(project: Project, *args: str, code: int = 0):
    result = run_cli(project, *args)
    assert "Traceback" not in result.stderr, result.stderr
    assert result.returncode == code, f"exit {result.returncode} for {args}:\n{result.stdout}{result.stderr}"
    return result


def archived(project: Project) -> int:
    return queue_depth(project.broker_url, f"{project.service}.archive")[0]


def test_the_json_of_every_command_validates_against_its_schema(make_project, tmp_path):
    project = make_project(APP)
    s = project.service

    plan = one_document("declare-dry-run", cli(project, "declare", "--dry-run", "--json").stdout)
    declared = one_document("declare", cli(project, "declare", "--json").stdout)
    assert declared["service"] == s and declared["broker"].startswith("amqp://guest:**@")
    assert declared["declared"]["queues"] == len(plan["queues"])
    assert declared["declared"]["exchanges"] == len(plan["exchanges"])
    assert declared["declared"]["bindings"] == sum(len(q["bindings"]) for q in plan["queues"])
    assert declared["declared"]["exchange_bindings"] == len(plan["exchange_bindings"])

    unhealthy = cli(project, "health", "--json", code=2)  # no worker: over the threshold, not an error
    report = one_document("health", unhealthy.stdout)
    assert report["healthy"] is False and report["problems"] and unhealthy.stderr == ""

    worker = project.worker().wait_ready()
    wait_for(lambda: queue_depth(project.broker_url, f"{s}.orders")[1] == 1, what="the worker consumes")
    healthy = one_document("health", cli(project, "health", "--json").stdout)
    assert healthy["healthy"] is True and healthy["problems"] == []
    rows = one_document("status", cli(project, "status", "--json", "--max-archive", "0").stdout)
    assert {r["queue"] for r in rows} == {q["name"] for q in plan["queues"]}
    assert [(q["queue"], q["role"]) for q in healthy["queues"]] == [(r["queue"], r["role"]) for r in rows]
    [tick] = one_document("schedules", cli(project, "schedules", "--json").stdout)
    assert (tick["schedule"], tick["every_s"], tick["queue"]) == ("tick", 3600, f"{s}.schedule.tick")

    published = one_document("publish", cli(project, "publish", "--message-id", "order-1", "--header",
                                            "x-tenant=acme", "--header", "x-priority:=3", "--header",
                                            'x-tags:=["a", 1]', "orders.1.created", '{"n": 1}', "--json").stdout)
    assert published == {"message_id": "order-1", "exchange": project.exchange, "routing_key": "orders.1.created",
                         "delay_s": 0.0, "headers": {"x-tenant": "acme", "x-priority": 3, "x-tags": ["a", 1]}}
    second = one_document("publish", cli(project, "publish", "orders.2.created", "{}", "--json").stdout)
    assert len(second["message_id"]) == 32 and second["headers"] == {}
    wait_for(lambda: archived(project) == 2, what="both archived by their handler")

    over = cli(project, "status", "--json", "--max-archive", "1", code=2)
    assert {r["queue"]: r["ready"] for r in one_document("status", over.stdout)}[f"{s}.archive"] == 2
    assert over.stderr.startswith("ALERT: archive holds 2 messages")

    listed = json_lines("archive-list", cli(project, "archive", "list", "--json").stdout)
    assert [m["id"] for m in listed] == ["order-1", second["message_id"]]
    shown = one_document("archive-show", cli(project, "archive", "show", "order-1", "--json").stdout)
    assert shown == listed[0]
    assert shown == json.loads(cli(project, "archive", "show", "order-1").stdout), "--json: the same document"
    assert {k: shown["headers"][k] for k in ("x-tenant", "x-priority", "x-tags")} == {
        "x-tenant": "acme", "x-priority": 3, "x-tags": ["a", 1]}, "the headers as published, types kept"
    missing = cli(project, "archive", "show", "no-such-id", "--json", code=1)
    assert missing.stdout == "" and "no-such-id" in missing.stderr, "an error prints no document"

    dry = one_document("archive-replay", cli(project, "archive", "replay", "--routing-key", "orders.1.*",
                                             "--dry-run", "--json").stdout)
    assert (dry["dry_run"], dry["matched"], [m["outcome"] for m in dry["messages"]]) == (True, 1, ["would_replay"])
    handled = len(project.records(handler="orders"))
    replayed = one_document("archive-replay", cli(project, "archive", "replay", "--routing-key", "orders.1.*",
                                                  "--json").stdout)
    assert (replayed["replayed"], replayed["kept"], replayed["messages"][0]["id"]) == (1, 0, "order-1")
    wait_for(lambda: len(project.records(handler="orders")) > handled and archived(project) == 2,
             what="the replayed event handled and archived again")

    would = one_document("archive-purge", cli(project, "archive", "purge", "--routing-key", "orders.2.*",
                                              "--dry-run", "--json").stdout)
    assert [m["id"] for m in would["messages"]] == [second["message_id"]]
    purged = one_document("archive-purge", cli(project, "archive", "purge", "--routing-key", "orders.2.*",
                                               "--yes", "--json").stdout)
    assert purged["purged"] == 1 and purged["messages"][0]["outcome"] == "purged"
    everything = one_document("archive-purge", cli(project, "archive", "purge", "--yes", "--json").stdout)
    assert (everything["matched"], everything["purged"], everything["erased"]) == (1, 1, 0)
    assert [m["outcome"] for m in everything["messages"]] == ["purged"]

    refused = cli(project, "migrate", "--to", "quorum", "--dry-run", "--json", code=1)  # the worker consumes
    assert refused.stdout == "" and "stop the service's workers first" in refused.stderr
    worker.kill()
    wait_for(lambda: queue_depth(project.broker_url, f"{s}.orders")[1] == 0, what="the worker gone")
    stay = one_document("migrate", cli(project, "migrate", "--to", "classic", "--dry-run", "--json").stdout)
    assert (stay["steps"], stay["moved"], stay["dry_run"], stay["declared_queue_type"]) == ([], None, True, "classic")
    assert all(q["exists"] and q["matches"] and q["why"] is None for q in stay["queues"])
    quorum = cli(project, "migrate", "--to", "quorum", "--dry-run", "--json")
    plan_quorum = one_document("migrate", quorum.stdout)
    # every queue but the exchange's shared delayed-publishing ladder, which keeps its type (other services use
    # it), and the archive, a stream whatever the queue type
    assert [q["queue"] for q in plan_quorum["queues"]] == [q["name"] for q in plan["queues"]
                                                           if q["role"] not in ("deferred", "unrouted", "archive")]
    assert all(q["exists"] and not q["matches"] and q["why"] for q in plan_quorum["queues"])
    assert {st["action"] for st in plan_quorum["steps"]} == {"declare-holding", "bind", "unbind", "move", "delete",
                                                              "declare"}
    assert "set queue_type='quorum' before starting its workers" in quorum.stderr

    path = tmp_path / "backlog.sqlite3"
    Backlog(path).store([(project.exchange, f"orders.{n}.created", build_message({}, message_id=f"b-{n}"))
                         for n in range(3)], now=0.0)
    waiting = one_document("backlog-status", cli(project, "backlog", "status", "--path", str(path), "--json",
                                                 "--max-age", "60", code=2).stdout)
    assert waiting["depth"] == 3
    flushed = one_document("backlog-flush", cli(project, "--broker", project.broker_url, "backlog", "flush",
                                                "--path", str(path), "--retry-rejected", "--json").stdout)
    assert flushed == {"path": str(path), "published": 3, "rejected": 0, "waiting": 0, "retried_rejected": 0,
                       "error": None}
    assert one_document("backlog-status", cli(project, "backlog", "status", "--path", str(path),
                                              "--json").stdout)["depth"] == 0


@pytest.mark.parametrize("command", [
    ["declare", "--json"], ["status", "--json"], ["schedules", "--json"], ["archive", "list", "--json"],
    ["archive", "show", "X", "--json"], ["archive", "replay", "--json"], ["archive", "purge", "--yes", "--json"],
    ["publish", "k", "{}", "--json"], ["migrate", "--to", "quorum", "--json"],
], ids=" ".join)
def test_an_error_exits_1_with_nothing_on_stdout(make_project, command):
    project = make_project(APP)
    result = cli(project, "--broker", "amqp://guest:guest@127.0.0.1:1//", *command, code=1)
    assert result.stdout == "" and result.stderr.startswith("Error: cannot reach the broker at amqp://guest:**@")
