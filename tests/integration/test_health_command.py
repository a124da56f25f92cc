"""`kombu-events health` against the real broker: exit 0 when all is well, else 2 with one line per problem
(over a threshold, in docs/cli.md's terms); 1 when the broker cannot be reached (an error)."""
from __future__ import annotations

import json

import pytest

from kombu_events.core.logs import safe_url

from .. import brokers
from .harness import management_queue, publish_amqp, queue_depth, run_cli, wait_for
from .json_schemas import assert_valid

pytestmark = pytest.mark.integration

PASSWORD = "s3cr3t-pw"
UNREACHABLE_URL = f"amqp://user:{PASSWORD}@127.0.0.1:1//"  # a closed port: refused at once

APP = """
events = Events(app, service=SERVICE, exchange=EXCHANGE, delay_levels=2)

@events.handler("orders.#")
def orders(payload):
    if payload.get("poison"):
        raise Archive("poison")

@events.handler("users.#")
def users(payload):
    pass
"""


def assert_reported_version(reported: str) -> str:
    """``reported`` (a ``broker_version``) if it is the version of the node the tests run on, as rabbitmqctl says."""
    assert isinstance(reported, str) and reported, reported
    if brokers.version():
        assert tuple(int(part) for part in reported.split(".")[:3]) == brokers.version(), reported
    return reported


def health(project, *args: str, code: int):
    result = run_cli(project, "health", *args)
    assert "Traceback" not in result.stderr, result.stderr
    assert result.returncode == code, result.stdout + result.stderr
    return result


def test_a_missing_topology_then_queues_without_consumers_are_problems(make_project):
    project = make_project(APP)
    s = project.service
    lines = health(project, code=2).stdout.splitlines()
    assert f"exchange {s}.archive: missing (run `kombu-events declare` or start a worker)" in lines
    assert f"queue {s}.orders: missing (run `kombu-events declare` or start a worker)" in lines
    plan = run_cli(project, "declare", "--dry-run").stdout.splitlines()
    entities = [line.split()[1] for line in plan if line.startswith(("exchange ", "queue "))]
    assert [line.split()[1].rstrip(":") for line in lines] == entities, "one line per missing entity"
    assert all(line.endswith("missing (run `kombu-events declare` or start a worker)") for line in lines)

    project.declare()
    result = health(project, code=2)
    assert result.stderr == ""
    why = "no consumer (paused: its circuit breaker is open, or no worker runs)"
    assert result.stdout.splitlines() == [f"queue {s}.orders: {why}", f"queue {s}.users: {why}"]
    report = json.loads(health(project, "--json", code=2).stdout)
    assert report["healthy"] is False and report["problems"] == result.stdout.splitlines()
    assert_valid("health", report)
    assert_reported_version(report["broker_version"])
    assert {q["broker_version"] for q in report["queues"]} == {report["broker_version"]}
    assert {q["queue"]: q["consumers"] for q in report["queues"] if q["role"] == "handler"} == {
        f"{s}.orders": 0, f"{s}.users": 0}


def test_a_running_worker_is_healthy_until_the_archive_holds_more_than_the_threshold(make_project):
    project = make_project(APP)
    s = project.service
    project.worker().wait_ready()
    wait_for(lambda: queue_depth(project.broker_url, f"{s}.users")[1] == 1, what="the worker consumes")
    assert health(project, "--max-archive", "0", code=0).stdout.startswith(f"healthy: {s} on amqp://guest:**@")
    report = assert_valid("health", json.loads(health(project, "--json", code=0).stdout))
    version = assert_reported_version(report["broker_version"])
    assert health(project, code=0).stdout == f"healthy: {s} on {safe_url(project.broker_url)} (RabbitMQ {version})\n"
    # Unacked counts from the management API Project.env() names (KOMBU_EVENTS_MANAGEMENT_URL): on 4.0 it is not
    # at the guessed http://127.0.0.1:15672. A new queue's counters reach the API with its first statistics.
    wait_for(lambda: "messages_unacknowledged" in management_queue(project.broker_url, f"{s}.users"),
             timeout=10, interval=0.2, what="management statistics of the users queue")
    report = json.loads(health(project, "--json", code=0).stdout)
    assert {q["queue"]: q["unacked"] for q in report["queues"]}[f"{s}.users"] == 0

    for n in range(2):
        publish_amqp(project.broker_url, project.exchange, "orders.1.created", b'{"poison": true}',
                     content_type="application/json", message_id=f"poison-{n}")
    wait_for(lambda: queue_depth(project.broker_url, f"{s}.archive")[0] == 2, what="two archived")
    health(project, "--max-archive", "2", code=0)
    result = health(project, "--max-archive", "1", code=2)
    assert result.stdout.splitlines() == [f"archive {s}.archive: 2 messages, more than --max-archive 1"]


def test_an_unreachable_broker_is_one_problem_with_the_password_masked(make_project):
    project = make_project(APP)
    result = run_cli(project, "--broker", UNREACHABLE_URL, "health", "--json")
    assert result.returncode == 1, result.stdout + result.stderr
    report = json.loads(result.stdout)
    [line] = report["problems"]
    assert line.startswith("broker: cannot reach the broker at amqp://user:**@127.0.0.1:1//"), line
    assert PASSWORD not in result.stdout + result.stderr
    assert report == {"healthy": False, "problems": [line], "broker_version": None, "queues": []}
    assert_valid("health", report)
    text = run_cli(project, "--broker", UNREACHABLE_URL, "health")
    assert (text.returncode, text.stdout) == (1, line + "\n"), "an error, not a threshold: exit 1"
