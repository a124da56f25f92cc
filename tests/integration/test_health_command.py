"""`kombu-events health` against the real broker: exit 0 when all is well, else 2 with one line per problem
(over a threshold, in docs/cli.md's terms); 1 when the broker cannot be reached (an error)."""
from __future__ import annotations

import json

import pytest

from .harness import publish_amqp, queue_depth, run_cli, wait_for
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
    assert {q["queue"]: q["consumers"] for q in report["queues"] if q["role"] == "handler"} == {
        f"{s}.orders": 0, f"{s}.users": 0}


def test_a_running_worker_is_healthy_until_the_archive_holds_more_than_the_threshold(make_project):
    project = make_project(APP)
    s = project.service
    project.worker().wait_ready()
    wait_for(lambda: queue_depth(project.broker_url, f"{s}.users")[1] == 1, what="the worker consumes")
    assert health(project, "--max-archive", "0", code=0).stdout.startswith(f"healthy: {s} on amqp://guest:**@")

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
    assert report == {"healthy": False, "problems": [line], "queues": []}
    assert_valid("health", report)
    text = run_cli(project, "--broker", UNREACHABLE_URL, "health")
    assert (text.returncode, text.stdout) == (1, line + "\n"), "an error, not a threshold: exit 1"
