"""Delayed publishing on the real broker: every subscriber of every service, never early, unrouted kept."""
from __future__ import annotations

import json

import pytest

from .harness import queue_depth, run_cli, wait_for

pytestmark = pytest.mark.integration

UNIT_MS = 100

SUBSCRIBER = """
events = Events(app, service=SERVICE, exchange=EXCHANGE, publish_delay_levels=8, publish_delay_unit_ms=100)

@events.handler("invoice.*", bind=True)
def on_invoice(event):
    record(service=SERVICE, n=event.payload["n"], routing_key=event.routing_key, received=time.time(),
           attempt=event.attempt)
"""

PUBLISH = """
import json, time
from {module} import events
sent = []
for n, delay in enumerate({delays!r}):
    sent.append({{"n": n, "delay": delay, "sent": time.time()}})
    events.publish("invoice.remind", {{"n": n}}, delay=delay)
print(json.dumps(sent))
"""


def test_a_delayed_event_reaches_every_subscribed_service_when_due_and_never_earlier(make_project):
    billing = make_project(SUBSCRIBER)
    audit = make_project(SUBSCRIBER, exchange=billing.exchange)
    for project in (billing, audit):
        project.worker().wait_ready()
    delays = [0.05, 0.1, 0.25, 0.5, 0.73, 1.0, 1.3, 2.0, 0, 0.1]
    result = billing.run_python(PUBLISH.format(module=billing.module, delays=delays))
    assert result.returncode == 0, result.stderr
    sent = {s["n"]: s for s in json.loads(result.stdout)}
    for project in (billing, audit):
        wait_for(lambda p=project: len(p.records()) >= len(delays), what=f"{project.service} got every event")
    for project in (billing, audit):
        got = project.records()
        assert sorted(r["n"] for r in got) == list(range(len(delays))), "each event once per service"
        assert {(r["routing_key"], r["attempt"]) for r in got} == {("invoice.remind", 1)}
        late_ms = [(r["received"] - sent[r["n"]]["sent"]) * 1000 - sent[r["n"]]["delay"] * 1000 for r in got]
        assert min(late_ms) >= -5, f"never earlier than asked (clock resolution aside): {late_ms}"
        assert max(late_ms) < UNIT_MS + 1000, f"at most a unit late, plus the worker's own latency: {late_ms}"
    assert queue_depth(billing.broker_url, f"{billing.exchange}.unrouted") == (0, 0)


def test_a_delayed_event_no_queue_is_bound_for_waits_in_the_unrouted_queue_and_status_says_so(make_project):
    project = make_project(SUBSCRIBER)
    project.declare()
    # 2 units: the level-1 queue dead-letters it to level 0's exchange, whose exchange binding hands it to the
    # due exchange; 1 unit: level 0's queue dead-letters it straight there. Both paths must reach the alternate.
    result = project.run_python(f"""
        from {project.module} import events
        events.publish("nobody.listens", {{"n": 1}}, delay=0.2)
        events.publish("nobody.listens", {{"n": 2}}, delay=0.1)
    """)
    assert result.returncode == 0, result.stderr
    unrouted = f"{project.exchange}.unrouted"
    wait_for(lambda: queue_depth(project.broker_url, unrouted)[0] == 2, what="both in the unrouted queue")
    status = run_cli(project, "status")
    assert status.returncode == 0, status.stderr
    assert f"2 delayed event(s) came due with no queue bound for their key: they wait in {unrouted}" in status.stderr
    assert any(line.split()[:3] == [unrouted, "unrouted", "2"] for line in status.stdout.splitlines())


def test_the_cli_publishes_with_a_delay_and_refuses_one_beyond_the_ladder(make_project):
    project = make_project(SUBSCRIBER)
    project.worker().wait_ready()
    ok = run_cli(project, "publish", "--delay", "0.3", "invoice.remind", '{"n": 5}')
    assert ok.returncode == 0, ok.stderr
    [got] = wait_for(lambda: project.records(n=5), what="the CLI's delayed event")
    assert got["routing_key"] == "invoice.remind"
    too_long = run_cli(project, "publish", "--delay", "26", "invoice.remind", '{"n": 6}')  # 255 units of 100 ms
    assert too_long.returncode == 1
    assert "hold at most 25500 ms" in too_long.stderr and "Traceback" not in too_long.stderr


RETRY_AT = """
from datetime import datetime, timedelta, timezone

events = Events(app, service=SERVICE, exchange=EXCHANGE, delay_unit_ms=100, delay_levels=8)

@events.handler("call.back", bind=True)
def call_back(event):
    now = datetime.now(timezone.utc)
    record(attempt=event.attempt, received=now.timestamp())
    if event.attempt == 1:
        raise Retry(at=now + timedelta(seconds=0.6))
"""


def test_retry_at_a_wall_clock_time_comes_back_then_as_the_next_attempt(make_project):
    project = make_project(RETRY_AT)
    project.worker().wait_ready()
    result = project.run_python(f"""
        from {project.module} import events
        events.publish("call.back", {{}})
    """)
    assert result.returncode == 0, result.stderr
    first, second = wait_for(lambda: len(project.records()) >= 2 and project.records(), what="the retry")
    assert (first["attempt"], second["attempt"]) == (1, 2)
    assert 0.6 <= second["received"] - first["received"] < 0.6 + 0.1 + 1.0, "at the time asked, within a unit"
