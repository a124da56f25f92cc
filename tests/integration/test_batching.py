"""Batched hand-off to prefork: a pool child killed -9 while it holds a batch loses nothing (exact accounting)."""
from __future__ import annotations

import collections
import os
import signal

import pytest

from kombu_events.publishing.publisher import Publisher, build_message

from .harness import queue_counts, wait_for

pytestmark = pytest.mark.integration

N = 600
#: The message whose handler waits to be killed: well into the run, when batches are full.
KILL_AT = 400

APP = f"""
class Settled(Middleware):
    def settled(self, delivery, outcome, step):  # main process: every settlement, exactly
        record(kind="settled", id=delivery.message_id, action=step.action, attempt=delivery.attempt,
               outcome=outcome.kind)

events = Events(app, service=SERVICE, exchange=EXCHANGE, delay_unit_ms=100, delay_levels=6, max_retries=3,
                middleware=[Settled()])

@events.handler("batch.#", bind=True)
def handle(event):
    i = event.payload["id"]
    if i == {KILL_AT} and event.attempt == 1:
        record(kind="holding", id=i)  # the test kills this pool child now
        time.sleep(120)
    record(kind="handled", id=i, attempt=event.attempt)
"""


def publish(broker_url, exchange, ids):
    publisher = Publisher(broker_url)
    try:
        items = [(exchange, f"batch.{i}", build_message({"id": i}, message_id=f"id-{i}")) for i in ids]
        assert publisher.publish_many(items) == [None] * len(items)
    finally:
        publisher.close()


def test_a_pool_child_killed_mid_batch_loses_nothing(make_project, broker_url):
    project = make_project(APP)
    project.declare()
    publish(broker_url, project.exchange, range(N))  # waiting before the worker starts: it reads full batches
    project.worker(pool="prefork", concurrency=2).wait_ready()
    (holding,) = wait_for(lambda: project.records(kind="holding"), timeout=60, what="the handler to kill")
    os.kill(holding["pid"], signal.SIGKILL)

    def all_settled():
        acked = {r["id"] for r in project.records(kind="settled", action="ack")}
        return len(acked) == N

    wait_for(all_settled, timeout=90, interval=0.3, what=f"{N} messages acked")
    by_id = collections.defaultdict(list)
    for r in project.records(kind="settled"):
        by_id[r["id"]].append((r["action"], r["attempt"], r["outcome"]))
    handled = collections.defaultdict(list)
    for r in project.records(kind="handled"):
        handled[f"id-{r['id']}"].append(r["attempt"])

    lost = {m for m, steps in by_id.items() if steps[0] == ("retry", 1, "lost")}
    assert f"id-{KILL_AT}" in lost
    assert len(lost) > 1, f"the killed child held only its own message: {sorted(lost)}"
    for message_id in (f"id-{i}" for i in range(N)):
        if message_id in lost:  # settled once as lost (retried), then acked once on attempt 2
            assert by_id[message_id] == [("retry", 1, "lost"), ("ack", 2, "ok")], message_id
            assert handled[message_id][-1] == 2 and set(handled[message_id]) <= {1, 2}, message_id
        else:
            assert by_id[message_id] == [("ack", 1, "ok")], message_id
            assert handled[message_id] == [1], message_id
    assert set(by_id) == {f"id-{i}" for i in range(N)}, "nothing settled that was not published"
    counts = queue_counts(broker_url)
    mine = {name: c[:2] for name, c in counts.items() if name.startswith(project.service + ".")}
    assert all(c == (0, 0) for c in mine.values()), f"left in the broker: {mine}"
    print(f"\n{project.service}: {N} acked; {len(lost)} lost with the killed child's batch, each retried once")
