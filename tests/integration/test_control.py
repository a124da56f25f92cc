"""``Control`` in a real prefork worker: a middleware pauses a queue at start and resumes it from a timer."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from .harness import publish_amqp, queue_depth, wait_for

pytestmark = pytest.mark.integration

GATED = """
from kombu_events import Middleware

OPEN = RECORDS + ".open"

class Gate(Middleware):
    def started(self, control):
        queue = SERVICE + ".gated"
        record(hook="started", queues=list(control.queues), paused=sorted(control.paused))
        if not os.path.exists(OPEN):
            control.pause(queue, "the gate is closed")

        def check():
            if os.path.exists(OPEN) and control.is_paused(queue):
                record(hook="resumed")
                control.resume(queue, prefetch=1)

        control.call_every(0.1, check)

    def stopped(self, control):
        record(hook="stopped")

events = Events(app, service=SERVICE, exchange=EXCHANGE, middleware=[Gate()])

@events.handler("gated.#", bind=True)
def gated(event):
    started = time.time()
    time.sleep(0.05)
    record(handler="gated", n=event.payload["n"], attempt=event.attempt, started=started, ended=time.time())

@events.handler("free.#")
def free(payload):
    record(handler="free", n=payload["n"])
"""


def test_a_paused_queue_waits_in_the_broker_while_others_flow_then_resumes_one_at_a_time(make_project):
    project = make_project(GATED)
    worker = project.worker(pool="prefork", concurrency=2).wait_ready()
    gated_queue = f"{project.service}.gated"
    [started] = wait_for(lambda: project.records(hook="started"), what="started hook")
    assert started["pid"] == worker.proc.pid, "started runs in the main process"
    assert started["queues"] == [gated_queue, f"{project.service}.free"] and started["paused"] == []

    def send(key: str, n: int) -> None:
        publish_amqp(project.broker_url, project.exchange, key, json.dumps({"n": n}).encode(),
                     content_type="application/json", message_id=f"{key}-{n}")

    for n in range(20):
        send("gated.x", n)
    for n in range(5):
        send("free.x", n)
    wait_for(lambda: len(project.records(handler="free")) == 5, what="the free queue handled")
    assert queue_depth(project.broker_url, gated_queue) == (20, 0), "paused: 20 waiting, no consumer"
    assert project.records(handler="gated") == []

    Path(str(project.records_path) + ".open").touch()
    wait_for(lambda: len(project.records(handler="gated")) >= 20, what="the gated queue handled after resume")
    handled = sorted(project.records(handler="gated"), key=lambda r: r["started"])
    assert sorted(r["n"] for r in handled) == list(range(20)), "every event once"
    assert {r["attempt"] for r in handled} == {1}, "pausing spends no attempt"
    overlaps = [(a["n"], b["n"]) for a, b in zip(handled, handled[1:]) if b["started"] < a["ended"]]
    assert overlaps == [], "resumed with prefetch 1: one at a time, though the pool has two processes"
    assert len(project.records(hook="resumed")) == 1
    wait_for(lambda: queue_depth(project.broker_url, gated_queue) == (0, 1), what="gated queue drained, consumed")

    worker.stop()
    assert project.records(hook="stopped"), "stopped runs on a warm shutdown"
