"""The ``kombu-events`` command, run as a user runs it, against the real broker and real workers.

Every test has its own service and events exchange (``make_project`` deletes all of
their queues and exchanges, even on failure). Handlers fail while the project's flag
file exists: the test "fixes the bug" by deleting it.
"""
from __future__ import annotations

import json
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import amqp
import pytest
from kombu import Connection

from kombu_events.broker import streams
from kombu_events.core import wire
from kombu_events.core.config import Settings
from kombu_events.core.logs import safe_url
from kombu_events.core.topology import build_topology
from kombu_events.ops.archive import ArchivedMessage, purge, purge_note

from .. import brokers
from .harness import (
    Project,
    _names,
    management_queue,
    peek_messages,
    publish_amqp,
    queue_depth,
    run_cli,
    unique,
    wait_for,
)
from .json_schemas import json_lines, one_document

pytestmark = pytest.mark.integration

LEVELS = 8
CLOSED_PORT_URL = "amqp://guest:guest@127.0.0.1:5999//"
PASSWORD = "s3cr3t-pw"
UNREACHABLE_URL = f"amqp://user:{PASSWORD}@127.0.0.1:1//"  # a closed port: refused at once

PUBLISH_LEVELS = 16  # the default publish_delay_levels

APP = f"""
FLAG = RECORDS + ".fail"

events = Events(app, service=SERVICE, exchange=EXCHANGE, delay_unit_ms=100, delay_levels={LEVELS},
                backoff=Exponential(base_ms=200, max_delay_ms=1000))

def handle(name, event):
    record(handler=name, attempt=event.attempt, routing_key=event.routing_key, message_id=event.message_id,
           payload=event.payload)
    if os.path.exists(FLAG):
        raise RuntimeError("flag file says fail")

@events.handler("orders.#", bind=True, max_retries=1)
def orders(event):
    handle("orders", event)

@events.handler("users.#", bind=True, max_retries=1)
def users(event):
    handle("users", event)
"""


@pytest.fixture
def make_project(make_project):
    """The shared fixture, with this file's two-handler app as the default body."""
    return lambda body=APP: make_project(body)


# -- helpers ----------------------------------------------------------------------------------------

def cli(project: Project, *args: str, code: int | None = 0):
    """Run the CLI; check its exit code (unless ``code`` is None) and that it crashed with no traceback."""
    result = run_cli(project, *args)
    output = result.stdout + result.stderr
    assert "Traceback (most recent call last)" not in result.stderr, output
    if code is not None:
        assert result.returncode == code, f"exit {result.returncode} for {args}:\n{output}"
    return result


def one_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    assert len(lines) == 1, lines
    return lines[0]


def flag(project: Project):
    return project.records_path.with_name(project.records_path.name + ".fail")


def send(project: Project, routing_key: str, payload: Any = None, **properties: Any) -> str:
    """Publish one JSON event to the project's exchange; return its message id."""
    properties.setdefault("message_id", unique("m"))
    properties.setdefault("content_type", "application/json")
    body = json.dumps(payload if payload is not None else {}).encode()
    publish_amqp(project.broker_url, project.exchange, routing_key, body, **properties)
    return properties["message_id"]


def queue(project: Project, name: str) -> str:
    return f"{project.service}.{name}"


def depth(project: Project, name: str) -> int:
    return queue_depth(project.broker_url, queue(project, name))[0]


def calls(project: Project, message_id: str | None = None) -> list[dict]:
    return [r for r in project.records() if message_id is None or r["message_id"] == message_id]


def archive_ids(project: Project) -> dict[str, str]:
    """message id -> queue it failed in, for everything in the archive (left there)."""
    return {m.properties["message_id"]: m.headers["kombu-events-queue"]
            for m in peek_messages(project.broker_url, queue(project, "archive"))}


def fill_archive(project: Project, routing_keys: list[str]) -> list[str]:
    """With a worker running and the flag set: publish, wait until all of them are archived."""
    flag(project).touch()
    ids = [send(project, key, {"key": key}) for key in routing_keys]
    wait_for(lambda: depth(project, "archive") >= len(ids), what=f"{len(ids)} archived messages")
    assert sorted(archive_ids(project)) == sorted(ids)
    return ids


def service_entities(project: Project, kind: str) -> list[str]:
    return sorted(n for n in _names(project.broker_url, kind) if n.startswith(project.service + "."))


# -- declare ------------------------------------------------------------------------------------------

def test_declare_dry_run_prints_the_plan_without_connecting(make_project):
    project = make_project()
    result = cli(project, "--broker", CLOSED_PORT_URL, "declare", "--dry-run")
    out = result.stdout
    s = project.service
    exchanges = [project.exchange, f"{s}.delivery", f"{s}.archive"] + [f"{s}.delay.{n}" for n in range(LEVELS)]
    for name in exchanges:
        assert f"exchange {name} " in out, name
    for name in ["orders", "users", "archive"] + [f"delay.{n}" for n in range(LEVELS)]:
        assert f"queue {s}.{name} " in out, name
    for level in range(LEVELS):
        assert f"x-message-ttl={100 << level}" in out
    assert (f"queue {s}.orders durable=True x-dead-letter-exchange={s}.delay.0 "
            f"x-dead-letter-routing-key={'0.' * (LEVELS - 1)}1.{s}.orders") in out
    assert f"x-dead-letter-exchange={s}.delivery" in out
    assert f"x-dead-letter-routing-key={'0.' * (LEVELS - 1)}1.{s}.orders" in out
    assert f"queue {s}.archive durable=True x-max-age=604800s x-max-length-bytes=1073741824" in out, "a stream"
    assert "x-queue-type=stream" in out
    assert f"<- exchange {project.exchange} key='orders.#'" in out
    assert f"<- exchange {project.exchange} key='users.#'" in out
    assert f"<- exchange {s}.delivery key='{'*.' * LEVELS}{s}.orders'" in out
    assert out.count(f"bind exchange {s}.") == LEVELS
    assert out.count(f"bind exchange {project.exchange}.deferred") == PUBLISH_LEVELS  # the exchange's own ladder
    assert f"<- exchange {project.exchange}.deferred key='{'*.' * PUBLISH_LEVELS}orders.#'" in out
    assert service_entities(project, "queues") == []  # nothing was declared
    assert project.exchange not in _names(project.broker_url, "exchanges")


def test_declare_dry_run_format_dot_prints_a_graph_without_connecting(make_project):
    project = make_project()
    out = cli(project, "--broker", CLOSED_PORT_URL, "declare", "--dry-run", "--format", "dot").stdout
    s = project.service
    assert out.startswith(f'digraph "{s}" {{\n') and out.endswith("}\n")
    assert f'"exchange:{project.exchange}" [shape=box' in out
    assert f'"queue:{s}.orders" [shape=ellipse' in out
    assert f'"exchange:{project.exchange}" -> "queue:{s}.orders" [label="orders.#"];' in out
    assert out.count("style=bold") == LEVELS + PUBLISH_LEVELS
    assert out.count("style=dashed") == LEVELS + 2 + PUBLISH_LEVELS
    assert out.count("style=dotted") == 1  # the due exchange's alternate, <exchange>.unrouted
    assert out == cli(project, "--broker", CLOSED_PORT_URL, "declare", "--dry-run", "--format", "dot").stdout
    assert service_entities(project, "queues") == []  # nothing was declared


def test_declare_format_dot_without_dry_run_is_a_usage_error(make_project):
    project = make_project()
    result = cli(project, "declare", "--format", "dot", code=1)  # a usage error is an error: 2 is for thresholds
    assert "--format dot" in result.stderr and "--dry-run" in result.stderr
    assert service_entities(project, "queues") == []


def test_declare_creates_the_topology_and_is_idempotent(make_project):
    project = make_project()
    for _ in range(2):
        result = cli(project, "declare")
        assert "guest:guest" not in result.stdout + result.stderr
        assert len(service_entities(project, "queues")) == LEVELS + 2 + 1  # levels + handlers + archive
        assert len(service_entities(project, "exchanges")) == LEVELS + 2  # levels + delivery + archive
        assert project.exchange in _names(project.broker_url, "exchanges")
    assert depth(project, "orders") == 0
    arguments = management_queue(project.broker_url, queue(project, "delay.3"))["arguments"]
    # exactly what the code declares, the queue type named (both RabbitMQ 3.10 and 4 list it as declared)
    assert arguments == {"x-queue-type": "classic", "x-message-ttl": 800,
                         "x-dead-letter-exchange": queue(project, "delay.2")}


def test_declare_reports_a_conflicting_queue_in_one_line(make_project):
    project = make_project()
    name = queue(project, "orders")
    with Connection(project.broker_url) as conn:
        conn.default_channel.queue_declare(name, durable=True, auto_delete=False,
                                           arguments={"x-message-ttl": 1234})
    result = cli(project, "declare", code=1)
    line = one_line(result.stderr)
    assert name in line and "x-message-ttl" in line, line


# -- status ---------------------------------------------------------------------------------------------

def test_status_shows_every_queue_and_alerts_on_the_archive(make_project):
    project = make_project()
    project.worker().wait_ready()
    cli(project, "status", "--max-archive", "0")  # empty archive: exit 0

    fill_archive(project, ["orders.1.created"])
    text = cli(project, "status").stdout
    for name in ["orders", "users", "archive"] + [f"delay.{n}" for n in range(LEVELS)]:
        assert queue(project, name) in text, name
    assert "ready" in text and "unacked" in text and "consumers" in text

    # A new queue's counters reach the management API with its first statistics (<= 5 s).
    wait_for(lambda: "messages_unacknowledged" in management_queue(project.broker_url, queue(project, "orders")),
             timeout=10, interval=0.2, what="management statistics of the orders queue")
    rows = {r["queue"]: r for r in json.loads(cli(project, "status", "--json").stdout)}
    assert len(rows) == LEVELS + 3 + PUBLISH_LEVELS + 1
    assert {r["role"] for r in rows.values()} == {"handler", "delay", "archive", "deferred", "unrouted"}
    assert rows[f"{project.exchange}.unrouted"]["role"] == "unrouted"
    assert all(rows[f"{project.exchange}.deferred.{n}"]["role"] == "deferred" for n in range(PUBLISH_LEVELS))
    orders, archive = rows[queue(project, "orders")], rows[queue(project, "archive")]
    assert orders["role"] == "handler" and orders["consumers"] == 1 and orders["ready"] == 0
    assert orders["unacked"] == 0  # from the management API
    assert archive["role"] == "archive" and archive["ready"] == 1 and archive["consumers"] == 0
    assert all(rows[queue(project, f"delay.{n}")]["role"] == "delay" for n in range(LEVELS))

    result = cli(project, "status", "--max-archive", "0", code=2)
    assert "archive" in result.stderr
    cli(project, "status", "--max-archive", "1")
    cli(project, "archive", "purge", "--yes")
    cli(project, "status", "--max-archive", "0")


HOLDING_APP = """
events = Events(app, service=SERVICE, exchange=EXCHANGE, delay_levels=2)

@events.handler("hold.#")
def hold(payload):
    record(held=True)
    time.sleep(120)  # the message stays unacked while the test looks (the worker is killed at the end)
"""

#: A management API nothing answers at (port 9, discard: refused at once on loopback).
DEAD_MANAGEMENT_URL = "http://127.0.0.1:9"


def cli_env(project: Project, *args: str, **env: str) -> subprocess.CompletedProcess:
    """``kombu-events -A <module> ARGS`` with ``env`` over the project's environment."""
    command = [str(Path(sys.executable).parent / "kombu-events"), "-A", project.module, *args]
    return subprocess.run(command, cwd=project.dir, env={**project.env(), **env}, capture_output=True, text=True,
                          timeout=60)


def test_status_reads_unacked_counts_from_the_management_api_the_setting_names_and_shows_the_version(
        make_project):
    """Project.env() sets KOMBU_EVENTS_MANAGEMENT_URL to the node's API (on 4.0 not at the guessed :15672)."""
    project = make_project(HOLDING_APP)
    hold = queue(project, "hold")
    worker = project.worker().wait_ready()
    send(project, "hold.1")
    wait_for(lambda: project.records(held=True), what="the handler holds the message")

    def unacked() -> Any:
        rows = one_document("status", cli(project, "status", "--json").stdout)
        return {r["queue"]: r["unacked"] for r in rows}[hold] == 1 and rows

    rows = wait_for(unacked, timeout=20, interval=0.5, what="status --json shows the held message as unacked")
    running = brokers.version()
    versions = {r["broker_version"] for r in rows}
    assert len(versions) == 1 and None not in versions, versions
    [reported] = versions
    if running:  # rabbitmqctl's word for the version the broker reported at connect
        assert tuple(int(part) for part in reported.split(".")[:3]) == running, (reported, running)

    text = cli(project, "status").stdout.splitlines()
    assert text[0] == f"broker: RabbitMQ {reported} at {safe_url(project.broker_url)}", text[0]
    assert text[1].startswith("queue ")

    elsewhere = cli_env(project, "status", "--json", KOMBU_EVENTS_MANAGEMENT_URL=DEAD_MANAGEMENT_URL)
    assert elsewhere.returncode == 0, elsewhere.stderr
    rows = json.loads(elsewhere.stdout)
    assert {r["unacked"] for r in rows if r["role"] != "archive"} == {None}, "the setting, not the guess, is asked"
    assert [r["unacked"] for r in rows if r["role"] == "archive"] == [0], "a stream holds nothing unacked"
    flag_wins = cli_env(project, "status", "--json", "--management-url", brokers.MANAGEMENT_URL,
                        KOMBU_EVENTS_MANAGEMENT_URL=DEAD_MANAGEMENT_URL)
    assert {r["queue"]: r["unacked"] for r in json.loads(flag_wins.stdout)}[hold] == 1, flag_wins.stderr

    connected = [line for line in worker.log.splitlines() if "kombu-events: connected to" in line]
    assert len(connected) == 1, connected  # one connection, one line
    assert connected[0].endswith(f"kombu-events: connected to RabbitMQ {reported} at "
                                 f"{safe_url(project.broker_url)}"), connected[0]


def test_an_invalid_management_url_is_one_line_naming_it_with_its_password_masked(make_project):
    project = make_project()
    for args, env, named in [
        (("status",), {"KOMBU_EVENTS_MANAGEMENT_URL": f"http://admin:{PASSWORD}@127.0.0.1:15672"},
         "KOMBU_EVENTS_MANAGEMENT_URL='http://**@127.0.0.1:15672' (setting management_url)"),
        (("status", "--management-url", f"amqp://admin:{PASSWORD}@127.0.0.1"), {},
         "--management-url='amqp://**@127.0.0.1' is not a management API URL (scheme amqp)"),
    ]:
        result = cli_env(project, *args, **env)
        assert result.returncode == 1, result.stdout + result.stderr
        assert named in one_line(result.stderr) and "Traceback" not in result.stderr, result.stderr
        assert PASSWORD not in result.stdout + result.stderr


# -- archive list / show / replay -------------------------------------------------------------------

def test_archive_list_show_and_dry_run_leave_the_archive_unchanged(make_project):
    project = make_project()
    project.worker().wait_ready()
    o1, o2, u1 = fill_archive(project, ["orders.1.created", "orders.2.created", "users.1.joined"])
    before = archive_ids(project)
    handled = len(calls(project))

    listing = cli(project, "archive", "list").stdout
    for message_id in (o1, o2, u1):
        line = next(line for line in listing.splitlines() if message_id in line)
        assert "max_retries=1" in line and "flag file says fail" in line and "attempts=2" in line
    assert f"queue={queue(project, 'users')}" in next(line for line in listing.splitlines() if u1 in line)
    only_users = cli(project, "archive", "list", "--queue", queue(project, "users")).stdout
    assert u1 in only_users and o1 not in only_users and o2 not in only_users
    as_json = [json.loads(line) for line in cli(project, "archive", "list", "--json").stdout.splitlines()]
    assert sorted(m["id"] for m in as_json) == sorted([o1, o2, u1])

    shown = json.loads(cli(project, "archive", "show", o2).stdout)
    assert shown["id"] == o2 and shown["queue"] == queue(project, "orders")
    assert shown["routing_key"] == "orders.2.created" and shown["attempts"] == 2
    assert "flag file says fail" in shown["reason"] and "RuntimeError" in shown["traceback"]
    assert json.loads(shown["body"]) == {"key": "orders.2.created"}
    missing = cli(project, "archive", "show", "no-such-id", code=1)
    assert "no-such-id" in one_line(missing.stderr)

    flag(project).unlink()  # even a working handler must not see dry-run messages
    dry = cli(project, "archive", "replay", "--dry-run").stdout
    assert all(f"(id {m}) to" in dry for m in (o1, o2, u1)) and dry.startswith("would replay ")
    time.sleep(0.3)  # a replayed message would be back at once: replay publishes with no delay
    assert archive_ids(project) == before
    assert len(calls(project)) == handled
    assert depth(project, "orders") == depth(project, "users") == 0


def test_archive_replay_with_queue_and_limit_replays_exactly_one(make_project):
    project = make_project()
    project.worker().wait_ready()
    ids = fill_archive(project, ["orders.1.created", "orders.2.created", "users.1.joined"])
    flag(project).unlink()
    handled = len(calls(project))

    result = cli(project, "archive", "replay", "--queue", queue(project, "orders"), "--limit", "1")
    [line] = [line for line in result.stdout.splitlines() if line.startswith("replayed ")]
    replayed = line.split("(id ")[1].split(")")[0]
    assert replayed in ids[:2] and line.endswith(queue(project, "orders"))
    wait_for(lambda: len(calls(project)) > handled, what="the replayed message handled")
    time.sleep(0.3)  # a second replayed message would be back at once: replay publishes with no delay
    assert [(r["message_id"], r["attempt"]) for r in calls(project)[handled:]] == [(replayed, 1)]
    left = archive_ids(project)
    assert sorted(left) == sorted(set(ids) - {replayed})


def test_archive_round_trip_fix_the_bug_then_replay(make_project):
    project = make_project()
    project.worker().wait_ready()
    keys = ["orders.1.created", "orders.2.created", "orders.3.paid", "users.1.joined", "users.2.left"]
    ids = fill_archive(project, keys)
    for message_id in ids:  # each failed twice (max_retries=1) before it was archived
        assert [r["attempt"] for r in calls(project, message_id)] == [1, 2]

    flag(project).unlink()  # the fix
    handled = len(calls(project))
    result = cli(project, "archive", "replay")
    assert "5 replayed, 0 kept" in result.stderr
    wait_for(lambda: len(calls(project)) >= handled + len(ids), what="every replayed message handled")
    time.sleep(0.3)  # a duplicate would be back at once: replay publishes with no delay
    replays = calls(project)[handled:]
    assert sorted(r["message_id"] for r in replays) == sorted(ids)
    for r in replays:
        assert r["attempt"] == 1
        assert r["routing_key"] == keys[ids.index(r["message_id"])]
        assert r["payload"] == {"key": r["routing_key"]}
    assert depth(project, "archive") == 0
    assert depth(project, "orders") == depth(project, "users") == 0
    assert sum(depth(project, f"delay.{n}") for n in range(LEVELS)) == 0


def test_archive_replay_keeps_messages_whose_queue_is_gone(make_project):
    project = make_project()
    worker = project.worker().wait_ready()
    order, user = fill_archive(project, ["orders.1.created", "users.1.joined"])
    worker.kill()
    with Connection(project.broker_url) as conn:  # the users queue was deleted on the broker
        conn.default_channel.queue_delete(queue(project, "users"))

    result = cli(project, "archive", "replay", code=1)
    assert f"(id {order}) to {queue(project, 'orders')}" in result.stdout
    assert user in result.stderr and "1 replayed, 1 kept" in result.stderr
    assert archive_ids(project) == {user: queue(project, "users")}
    assert depth(project, "orders") == 1  # back in its queue, for the next worker

    # The handler was removed from the app: its archived messages stay too.
    without_users = Project(project.dir, project.broker_url, APP.split("@events.handler(\"users")[0],
                            service=project.service, module=project.module, exchange=project.exchange)
    assert without_users.module == project.module
    result = cli(project, "archive", "replay", code=1)
    assert user in result.stderr and queue(project, "users") in result.stderr
    assert archive_ids(project) == {user: queue(project, "users")}


# -- archive purge ------------------------------------------------------------------------------------

def test_archive_purge_needs_yes_and_can_select_a_queue(make_project):
    project = make_project()
    project.worker().wait_ready()
    o1, o2, _u1 = fill_archive(project, ["orders.1.created", "orders.2.created", "users.1.joined"])

    refused = cli(project, "archive", "purge", code=1)
    assert "--yes" in refused.stderr and "--dry-run" in refused.stderr and refused.stdout == ""
    assert depth(project, "archive") == 3

    result = cli(project, "archive", "purge", "--queue", queue(project, "users"), "--yes")
    assert "purged 1 message(s)" in result.stderr and "until retention" in result.stderr
    assert archive_ids(project) == {o1: queue(project, "orders"), o2: queue(project, "orders")}

    result = cli(project, "archive", "purge", "--yes")
    assert "purged 2 message(s)" in result.stderr
    assert depth(project, "archive") == 0


def archive_directly(project: Project, entries: list[tuple[str, str]]) -> list[str]:
    """Put one message per ``(handler, routing key)`` straight into the archive, in this order, with the
    headers the worker archives with; return their message ids. No worker: the order is the test's."""
    ids = []
    for handler, routing_key in entries:
        message_id = unique("m")
        headers = wire.archive_headers({"x-request-id": f"r-{message_id}"}, attempt=2, queue=queue(project, handler),
                                       routing_key=routing_key, reason="gave up after 2 attempts (max_retries=1)",
                                       exception="RuntimeError: flag file says fail", traceback="Traceback ...")
        publish_amqp(project.broker_url, queue(project, "archive"), "", json.dumps({"key": routing_key}).encode(),
                     message_id=message_id, content_type="application/json", delivery_mode=2,
                     application_headers=headers)
        ids.append(message_id)
    return ids


def archive_contents(project: Project) -> list[tuple[str, bytes, dict]]:
    """(message id, body, headers) of every copy still archived, in archive order (a read changes nothing)."""
    return [(m.properties["message_id"], m.body, m.headers) for m in peek_messages(project.broker_url,
                                                                                    queue(project, "archive"))]


def keys_of(project: Project) -> dict[str, str]:
    """message id -> archive key of every copy still archived."""
    return {m.properties["message_id"]: m.key for m in peek_messages(project.broker_url, queue(project, "archive"))}


MIXED = [("users", "users.1.joined"), ("orders", "orders.1.created"), ("orders", "orders.3.paid"),
         ("orders", "orders.2.created"), ("users", "users.2.created")]


def test_archive_purge_dry_run_reports_what_would_go_and_removes_nothing(make_project):
    project = make_project()
    project.declare()
    u1, o1, o3, o2, u2 = archive_directly(project, MIXED)
    before = archive_contents(project)
    assert [m[0] for m in before] == [u1, o1, o3, o2, u2]
    orders = queue(project, "orders")

    key = keys_of(project)
    dry = cli(project, "archive", "purge", "--routing-key", "orders.*.created", "--dry-run")  # no --yes needed
    assert dry.stdout.splitlines() == [f"would purge {key[o1]} (id {o1}) from {orders} (key orders.1.created)",
                                       f"would purge {key[o2]} (id {o2}) from {orders} (key orders.2.created)"]
    assert dry.stderr.splitlines()[0] == "2 message(s) would be purged"
    assert dry.stderr.splitlines()[1].startswith("read through archive offset ")

    def would_go(*args: str) -> list[str]:
        report = one_document("archive-purge", cli(project, "archive", "purge", *args, "--dry-run", "--json").stdout)
        assert report["dry_run"] is True and report["purged"] == 0 and report["matched"] == len(report["messages"])
        assert {m["outcome"] for m in report["messages"]} <= {"would_purge"}
        return [m["id"] for m in report["messages"]]

    assert would_go("--routing-key", "orders.*.created") == [o1, o2]
    assert would_go("--routing-key", "orders.*.created", "--limit", "1") == [o1]
    assert would_go("--routing-key", "*.*.created") == [o1, o2, u2]
    assert would_go("--routing-key", "*.*.created", "--queue", orders) == [o1, o2]
    assert would_go("--routing-key", "orders.#") == [o1, o3, o2]
    assert would_go("--routing-key", "orders.3.paid") == [o3]  # a plain key: that key only
    assert would_go("--routing-key", "orders") == []
    assert would_go("--routing-key", "#") == would_go() == [u1, o1, o3, o2, u2]
    assert would_go("--limit", "2") == [u1, o1]
    assert would_go("--yes", "--routing-key", "#") == [u1, o1, o3, o2, u2], "--dry-run wins over --yes"
    assert archive_contents(project) == before, "a dry run removes nothing and keeps the order"

    # list and replay select alike: what purge --dry-run says is what they see
    listed = json_lines("archive-list", cli(project, "archive", "list", "--routing-key", "*.*.created",
                                            "--json").stdout)
    assert [m["id"] for m in listed] == [o1, o2, u2]
    replay = cli(project, "archive", "replay", "--routing-key", "*.*.created", "--limit", "2", "--dry-run")
    assert [line.split()[2] for line in replay.stdout.splitlines()] == [key[o1], key[o2]]
    assert archive_contents(project) == before


def test_a_dry_run_pins_its_copies_with_through_and_a_copy_archived_after_it_stays(make_project):
    """Replay and purge act on exactly the copies their dry run showed: it reports the offset it read through and
    the command line with ``--through``; a matching copy archived after the dry run stays archived.

    Mutation check: were --through left out of the selection, the real runs would take o3 (and o4) too.
    """
    project = make_project()
    project.declare()
    o1, o2 = archive_directly(project, [("orders", "orders.1.created"), ("orders", "orders.2.created")])
    orders = queue(project, "orders")
    dry = one_document("archive-replay", cli(project, "archive", "replay", "--queue", orders, "--dry-run",
                                             "--json").stdout)
    assert [m["id"] for m in dry["messages"]] == [o1, o2] and isinstance(dry["through"], int)
    assert dry["command"] == shlex.join(["kombu-events", "-A", project.module, "archive", "replay", "--queue",
                                         orders, "--through", str(dry["through"])])
    (o3,) = archive_directly(project, [("orders", "orders.3.created")])
    pinned = json_lines("archive-list", cli(project, "archive", "list", "--through", str(dry["through"]),
                                            "--json").stdout)
    assert [m["id"] for m in pinned] == [o1, o2], "list --through: the dry run's copies, not o3"
    assert all(m["offset"] <= dry["through"] for m in pinned)

    real = one_document("archive-replay", cli(project, *shlex.split(dry["command"])[3:], "--json").stdout)
    assert [(m["id"], m["outcome"]) for m in real["messages"]] == [(o1, "replayed"), (o2, "replayed")]
    assert (real["through"], real["command"]) == (dry["through"], None)
    assert [m[0] for m in archive_contents(project)] == [o3], "archived after the dry run: still archived"

    text = cli(project, "archive", "purge", "--routing-key", "orders.#", "--dry-run")
    key3 = keys_of(project)[o3]
    assert text.stdout.splitlines() == [f"would purge {key3} (id {o3}) from {orders} (key orders.3.created)"]
    line = text.stderr.splitlines()[-1]
    through = line.removeprefix("read through archive offset ").split(";")[0]
    assert "; to purge exactly this one, none archived since: " in line, line
    command = line.split(", none archived since: ", 1)[1]
    assert command == shlex.join(["kombu-events", "-A", project.module, "archive", "purge", "--routing-key",
                                  "orders.#", "--through", through, "--yes"])
    (o4,) = archive_directly(project, [("orders", "orders.4.created")])
    purged = one_document("archive-purge", cli(project, *shlex.split(command)[3:], "--json").stdout)
    assert [m["id"] for m in purged["messages"]] == [o3]
    assert (purged["hidden_until_retention"], purged["note"]) == (True, purge_note())
    assert [m[0] for m in archive_contents(project)] == [o4], "archived after the dry run: still archived"


def test_archive_purge_by_pattern_deletes_exactly_the_matching_messages(make_project):
    """Purge never removes a message that does not match: the others stay, in order, bodies and headers intact.

    Mutation check: were purge to ignore --routing-key, the first purge would take u1, not o1, and this fails.
    """
    project = make_project()
    project.declare()
    u1, o1, o3, o2, u2 = archive_directly(project, MIXED)
    before = archive_contents(project)

    def left_after(purged: set[str]) -> list[tuple[str, bytes, dict]]:
        return [m for m in before if m[0] not in purged]

    report = one_document("archive-purge", cli(project, "archive", "purge", "--routing-key", "orders.*.created",
                                               "--limit", "1", "--yes", "--json").stdout)
    assert (report["dry_run"], report["matched"], report["purged"]) == (False, 1, 1)
    assert [(m["id"], m["outcome"], m["routing_key"]) for m in report["messages"]] == [
        (o1, "purged", "orders.1.created")]
    assert archive_contents(project) == left_after({o1})

    key = keys_of(project)
    result = cli(project, "archive", "purge", "--routing-key", "orders.*.created", "--yes")
    assert result.stdout == f"purged {key[o2]} (id {o2}) from {queue(project, 'orders')}\n"  # the one match left
    assert archive_contents(project) == left_after({o1, o2})

    report = one_document("archive-purge", cli(project, "archive", "purge", "--queue", queue(project, "users"),
                                               "--routing-key", "users.#", "--yes", "--json").stdout)
    assert [m["id"] for m in report["messages"]] == [u1, u2]
    assert archive_contents(project) == left_after({o1, o2, u1, u2})

    nothing = cli(project, "archive", "purge", "--routing-key", "no.such.key", "--yes")
    assert nothing.stdout == "" and nothing.stderr.startswith("purged 0 message(s)")
    assert archive_contents(project) == left_after({o1, o2, u1, u2}) and [m[0] for m in before].index(o3) == 2

    everything = one_document("archive-purge", cli(project, "archive", "purge", "--yes", "--json").stdout)
    assert (everything["matched"], everything["purged"], everything["erased"]) == (1, 1, 0)
    assert [m["id"] for m in everything["messages"]] == [o3]
    assert archive_contents(project) == []


def test_a_purge_that_fails_half_way_loses_no_message(make_project):
    """The process dies in the middle of a selective purge's selection: nothing was settled, everything is there."""
    project = make_project()
    project.declare()
    u1, o1, o3, o2, _u2 = archive_directly(project, MIXED)
    before = archive_contents(project)
    topology = build_topology(Settings(service=project.service, exchange=project.exchange), ())
    seen: list[str] = []

    def match(message: ArchivedMessage) -> bool:
        seen.append(message.id)
        if len(seen) == 4:
            raise RuntimeError("the operator's laptop dies here")
        return message.routing_key.startswith("orders.")

    with Connection(project.broker_url) as conn, pytest.raises(RuntimeError, match="laptop"):
        purge(conn, topology, match)
    assert seen == [u1, o1, o3, o2]
    assert archive_contents(project) == before


def test_archive_purge_killed_mid_way_loses_no_message(make_project):
    """kill -9 while purge --routing-key reads and settles a large archive: every copy that does not match is still
    listed, once, in order; a matching one is listed or settled as purged, never both; the stream loses nothing."""
    project = make_project()
    project.declare()
    count = 3000
    keys = [("orders", f"orders.{n}.created") if n % 3 else ("users", f"users.{n}.joined") for n in range(count)]
    with Connection(project.broker_url) as conn:  # one confirmed channel: quicker than a publish_amqp each
        channel = conn.channel()
        channel.confirm_select()
        for n, (handler, key) in enumerate(keys):
            headers = {"kombu-events-queue": queue(project, handler), "kombu-events-routing-key": key}
            channel.basic_publish(amqp.Message(b"{}", message_id=f"m-{n}", application_headers=headers,
                                               delivery_mode=2), exchange=queue(project, "archive"), routing_key="")
        channel.close()
    kept = [f"m-{n}" for n, (_handler, key) in enumerate(keys) if key.startswith("users.")]
    matching = {f"m-{n}" for n, (_handler, key) in enumerate(keys) if key.startswith("orders.")}
    for delay in (0.2, 0.6, 1.2):  # killed before, during and after the settlement records
        run = subprocess.Popen([str(Path(sys.executable).parent / "kombu-events"), "-A", project.module, "archive",
                                "purge", "--routing-key", "orders.#", "--yes"], cwd=project.dir, env=project.env(),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        time.sleep(delay)
        run.send_signal(signal.SIGKILL)
        run.wait()
        left = [m[0] for m in archive_contents(project)]
        assert [i for i in left if i not in matching] == kept, "every copy that did not match: listed, in order"
        assert len(left) == len(set(left)), "no duplicate"
        print(f"\n[archive purge] kill -9 after {delay} s: {len(matching - set(left))} of {len(matching)} matching "
              f"purged, {len(kept)} not matching all listed")
    with Connection(project.broker_url) as conn:
        stored = [o for o, m in streams.read(conn.connection, queue(project, "archive"))
                  if "kombu-events-settlement" not in m.headers]
    assert len(stored) == count, "a purge removes nothing from the stream"


# -- publish ---------------------------------------------------------------------------------------------

def test_publish_reaches_the_handler(make_project):
    project = make_project()
    project.worker().wait_ready()
    result = cli(project, "publish", "orders.9.created", '{"n": 9, "note": "caf\\u00e9"}')
    message_id = result.stdout.strip()
    [call] = wait_for(lambda: calls(project, message_id), what="the published event handled")
    assert call["payload"] == {"n": 9, "note": "caf\u00e9"}
    assert call["routing_key"] == "orders.9.created" and call["handler"] == "orders"

    chosen = unique("order-9-")
    result = cli(project, "publish", "--message-id", chosen, "--header", "x-tenant=acme", "--header", "x-n:=9",
                 "orders.9.paid", "{}")
    assert result.stdout == chosen + "\n", "the human output: the message id, as before"
    [call] = wait_for(lambda: calls(project, chosen), what="the event with its own message id handled")
    assert call["routing_key"] == "orders.9.paid"


def test_publish_errors_are_one_clear_line(make_project):
    project = make_project()

    bad = cli(project, "--broker", CLOSED_PORT_URL, "publish", "orders.1.created", "{not json", code=1)
    assert "JSON" in one_line(bad.stderr)

    down = cli(project, "--broker", CLOSED_PORT_URL, "publish", "orders.1.created", "{}", code=1)
    line = one_line(down.stderr)
    assert "5999" in line and ":guest@" not in down.stdout + down.stderr, line

    unknown = cli(project, "--service", "nosuchservice", "publish", "orders.1.created", "{}", code=1)
    line = one_line(unknown.stderr)
    assert "nosuchservice" in line and project.service in line, line


@pytest.mark.parametrize("command", [
    ["declare"], ["status"], ["archive", "list"], ["archive", "show", "X"], ["archive", "replay"],
    ["archive", "purge", "--yes"], ["publish", "k", "{}"],
], ids=" ".join)
def test_an_unreachable_broker_is_one_line_without_the_password(make_project, command):
    project = make_project()
    result = cli(project, "--broker", UNREACHABLE_URL, *command, code=1)
    line = one_line(result.stderr)
    assert PASSWORD not in result.stdout + result.stderr, line
    assert "amqp://user:**@127.0.0.1:1//" in line, line


BLOBS = f"""
events = Events(app, service=SERVICE, exchange=EXCHANGE, delay_unit_ms=100, delay_levels={LEVELS})

@events.handler("blobs.#", raw=True)
def blobs(payload):
    record(handler="blobs", message_id=None)
    raise Archive("keep it for replay")
"""


def test_archive_replay_keeps_the_body_bytes_of_any_content_encoding(make_project):
    project = make_project(BLOBS)
    worker = project.worker().wait_ready()
    body = "caf\u00e9 cr\u00e8me".encode("latin-1")
    properties = {"message_id": unique("m"), "content_type": "text/plain", "content_encoding": "latin-1",
                  "application_headers": {"x-request-id": "r-1"}}
    publish_amqp(project.broker_url, project.exchange, "blobs.1", body, **properties)
    wait_for(lambda: depth(project, "archive") == 1, what="the message archived")
    worker.kill()

    cli(project, "archive", "replay")
    with Connection(project.broker_url) as conn:
        channel = conn.channel()
        channel.auto_decode = False  # see the bytes on the wire
        replayed: amqp.Message = wait_for(lambda: channel.basic_get(queue(project, "blobs"), no_ack=True),
                                          what="the replayed message")
    assert replayed.body == body
    assert replayed.properties["content_encoding"] == "latin-1"
    assert replayed.properties["application_headers"]["x-request-id"] == "r-1"
