"""Ordered handlers: events of one key handled in publish order, keys in parallel over partition queues fed by
RabbitMQ's consistent-hash exchange; published by Node.js (the ``kombu-events-key`` header) and from Python
(``publish(..., key=)``). Counted from the handlers' own records, across every process of two workers."""
from __future__ import annotations

import collections
import json
import subprocess
import time

import pytest
from celery import Celery

from kombu_events import ConfigurationError, Events

from ..brokers import RABBITMQCTL
from .harness import _vhost, node_message, queue_counts, run_cli, wait_for

pytestmark = pytest.mark.integration

KEYS, PER_KEY = 20, 30

APP = """
import random

events = Events(app, service=SERVICE, exchange=EXCHANGE, delay_unit_ms=100, delay_levels=4)

@events.handler("orders.#", bind=True, ordered_by="key", partitions=8, hold_failures=False)
def orders(event):
    record(kind="start", key=event.headers["kombu-events-key"], seq=event.payload["seq"])
    time.sleep(random.random() * 0.004)
    record(kind="end", key=event.headers["kombu-events-key"], seq=event.payload["seq"])
"""


def test_each_keys_events_in_publish_order_keys_in_parallel_over_two_workers(make_project, broker_url):
    project = make_project(APP)
    for _ in range(2):
        project.worker(pool="prefork", concurrency=2).wait_ready()
    messages = [node_message(f"orders.k{key}", {"seq": seq}, messageId=f"k{key}-{seq}",
                             headers={"kombu-events-key": f"k{key}"})
                for seq in range(PER_KEY) for key in range(KEYS)]
    project.node_publish(*messages)
    wait_for(lambda: len(project.records(kind="end")) >= KEYS * PER_KEY, timeout=120, interval=0.3,
             what=f"{KEYS * PER_KEY} events handled")
    time.sleep(0.5)  # a duplicate would show by now

    records = project.records()
    by_key: dict[str, list[int]] = collections.defaultdict(list)
    for r in records:
        if r["kind"] == "end":
            by_key[r["key"]].append(r["seq"])
    assert by_key == {f"k{key}": list(range(PER_KEY)) for key in range(KEYS)}, "every key in publish order, once"
    running: dict[str, int] = collections.Counter()
    for r in records:  # the file's order is the order of the calls: a key never runs twice at once
        running[r["key"]] += 1 if r["kind"] == "start" else -1
        assert running[r["key"]] in (0, 1), f"key {r['key']} ran on two processes at once"
    pids = {r["pid"] for r in records}
    assert len(pids) >= 2, "the keys ran in parallel, on more than one process"
    partitions = sorted(n for n in queue_counts(broker_url) if n.startswith(f"{project.service}.orders.p"))
    assert partitions == [f"{project.service}.orders.p{i}" for i in range(8)]
    # The last acks follow the last records: on a loaded machine they may take longer than the sleep above.
    wait_for(lambda: [queue_counts(broker_url)[n] for n in partitions] == [(0, 0, 2)] * 8, timeout=30,
             interval=0.5, what="nothing left in the partitions, each consumed by both workers")
    assert sorted(active_consumers(broker_url, project.service)) == partitions, "one of them active on each"
    def status() -> dict[str, dict]:
        return {r["queue"]: r for r in json.loads(run_cli(project, "status", "--json").stdout)}

    # The management API reports consumers from its statistics, collected every 5 s: a loaded machine lags.
    wait_for(lambda: None not in {status()[n]["holder"] for n in partitions}, timeout=60, interval=2,
             what="status naming each partition's active consumer")
    rows = status()
    holders = {rows[n]["holder"] for n in partitions}
    assert 1 <= len(holders) <= 2, f"status names each partition's worker: {holders}"
    assert all(" -> " in h for h in holders), "the holder's connection, as the management API names it"
    def text_names_the_holders() -> bool:
        text = run_cli(project, "status").stdout
        return all(f"consuming (active: {rows[n]['holder']})" in text for n in partitions)

    wait_for(text_names_the_holders, timeout=60, interval=2,
             what="the text status naming the same holders (statistics of a loaded broker lag)")


def active_consumers(broker_url: str, service: str) -> list[str]:
    """The partitions of ``service`` with an active consumer, once per active consumer (rabbitmqctl)."""
    out = subprocess.run([*RABBITMQCTL, "-q", "list_consumers", "-p", _vhost(broker_url), "--no-table-headers",
                          "queue_name", "active"], capture_output=True, text=True, check=True).stdout
    rows = [line.rsplit("\t", 1) for line in out.splitlines() if "\t" in line]
    return [name for name, active in rows if name.startswith(service + ".orders.p") and active.strip() == "true"]


def test_publish_with_a_key_reaches_the_keys_partition_in_order(make_project, broker_url):
    project = make_project(APP)
    project.worker(pool="threads", concurrency=4).wait_ready()
    events = Events(Celery("publisher", broker=broker_url), service="publisher", exchange=project.exchange)
    for seq in range(50):
        events.publish("orders.any", {"seq": seq}, key=f"k{seq % 3}")
    wait_for(lambda: len(project.records(kind="end")) >= 50, timeout=60, interval=0.3, what="50 events handled")
    by_key: dict[str, list[int]] = collections.defaultdict(list)
    for r in project.records(kind="end"):
        by_key[r["key"]].append(r["seq"])
    assert by_key == {f"k{k}": list(range(k, 50, 3)) for k in range(3)}


def test_an_ordering_that_cannot_work_is_refused_at_registration():
    events = Events(Celery("t", broker="memory://"), service="refused")
    with pytest.raises(ConfigurationError, match="ordered_by must be one of"):
        events.handler("orders.#", ordered_by="body", partitions=4)
    with pytest.raises(ConfigurationError, match=r"partitions must be an integer within 1 \.\. 1024"):
        events.handler("orders.#", ordered_by="key", partitions=0)
    with pytest.raises(ConfigurationError, match="partitions= needs ordered_by="):
        events.handler("orders.#", partitions=4)
    with pytest.raises(ConfigurationError, match="key must be a non-empty string"):
        events.publish("orders.x", {}, key=7)


HOLDING = """
import random

events = Events(app, service=SERVICE, exchange=EXCHANGE, delay_unit_ms=100, delay_levels=4)

@events.handler("orders.#", bind=True, ordered_by="key", partitions=16, max_retries=3,
                backoff=Constant(every_ms=200))
def orders(event):
    key, seq = event.headers["kombu-events-key"], event.payload["seq"]
    record(kind="start", key=key, seq=seq, attempt=event.attempt)
    time.sleep(random.random() * 0.003)
    if event.payload["fail"] and event.attempt == 1:
        record(kind="failed", key=key, seq=seq)
        raise RuntimeError("fails its first attempt, by design")
    record(kind="end", key=key, seq=seq, attempt=event.attempt)
"""

HOLD_KEYS, HOLD_PER_KEY = 50, 100


def test_a_failing_event_holds_its_partition_through_kill_9_and_a_new_worker_in_order_none_lost(make_project,
                                                                                                broker_url):
    """The issue's proof: 3 workers (prefork -c 2), 50 keys x 100 events from Node.js, 10 % failing their first
    attempt; one worker killed with -9 mid-run and a fourth started; every key handled in publish order, no key
    on two processes at once, none lost."""
    project = make_project(HOLDING)
    workers = [project.worker(pool="prefork", concurrency=2).wait_ready() for _ in range(3)]
    fails = {(key, seq) for key in range(HOLD_KEYS) for seq in range(HOLD_PER_KEY) if (key * 7 + seq) % 10 == 0}
    project.node_publish(*[
        node_message(f"orders.k{key}", {"seq": seq, "fail": (key, seq) in fails}, messageId=f"k{key}-{seq}",
                     headers={"kombu-events-key": f"k{key}"})
        for seq in range(HOLD_PER_KEY) for key in range(HOLD_KEYS)])
    total = HOLD_KEYS * HOLD_PER_KEY
    wait_for(lambda: len(project.records(kind="end")) >= total // 3, timeout=120, interval=0.2,
             what="a third of the events handled")
    workers[0].kill()  # -9, mid-run: its partitions move to the others, its unacked events are redelivered
    project.worker(pool="prefork", concurrency=2).wait_ready()
    wait_for(lambda: len({(r["key"], r["seq"]) for r in project.records(kind="end")}) >= total, timeout=240,
             interval=0.5, what=f"{total} events handled")
    time.sleep(1.0)

    records = project.records()
    ends: dict[str, list[int]] = collections.defaultdict(list)
    for r in records:
        if r["kind"] == "end":
            ends[r["key"]].append(r["seq"])
    for key in range(HOLD_KEYS):
        handled = ends[f"k{key}"]
        deduplicated = [seq for i, seq in enumerate(handled) if seq not in handled[:i]]
        assert deduplicated == list(range(HOLD_PER_KEY)), f"k{key}: handled out of publish order"
        assert handled == sorted(handled), f"k{key}: a later event ran before an earlier one ended"
    ended, calling = set(), {}
    for i, r in enumerate(records):  # a pool process makes one call at a time: its start, then its end
        if r["kind"] == "start":
            calling[r["pid"]] = i
        else:
            ended.add(calling.pop(r["pid"], None))
    unended = [records[i] for i in calling.values()]
    assert len(unended) <= 2, f"only the killed worker's two processes leave a call unended: {unended}"
    running: dict[str, set[int]] = collections.defaultdict(set)
    for i, r in enumerate(records):  # the file's order is the calls' order
        if r["kind"] == "start" and i not in ended:
            continue  # killed with its worker
        if r["kind"] == "start":
            assert not running[r["key"]], f"key {r['key']} ran on two processes at once"
            running[r["key"]].add(r["pid"])
        else:
            running[r["key"]].discard(r["pid"])
    failed_then = [(r["key"], r["seq"]) for r in records if r["kind"] == "failed"]
    assert {(f"k{k}", s) for k, s in fails} <= set(failed_then), "each failing event failed once at least"
    counts = queue_counts(broker_url)
    left = {n: counts[n][:2] for n in counts if n.startswith(project.service + ".") and not n.endswith(".archive")}
    assert all(c == (0, 0) for c in left.values()), f"left in the broker: {left}"


STALLING = """
import pathlib

events = Events(app, service=SERVICE, exchange=EXCHANGE, delay_unit_ms=100, delay_levels=4)
STALLED = pathlib.Path(RECORDS + ".stalled")

@events.handler("orders.#", bind=True, ordered_by="key", partitions=2, max_retries=3,
                backoff=Constant(every_ms=200))
def orders(event):
    record(kind="start", seq=event.payload["seq"], attempt=event.attempt)
    if event.payload["seq"] == 0 and not STALLED.exists():
        STALLED.touch()
        time.sleep(120)  # its worker is killed here, before the attempt ends
    if event.payload["seq"] == 0 and event.attempt == 1:
        record(kind="failed", seq=0, attempt=event.attempt)
        raise RuntimeError("fails its first attempt, by design")
    record(kind="end", seq=event.payload["seq"], attempt=event.attempt)
"""


def test_an_event_redelivered_to_a_held_partition_runs_as_the_same_attempt(make_project):
    """A worker killed -9 in the middle of an event's first attempt: the next worker runs it as attempt 1 again
    (the first never ended), so its failure is a failure and its retry attempt 2, before the key's next event."""
    project = make_project(STALLING)
    first = project.worker(pool="prefork", concurrency=2).wait_ready()
    project.node_publish(*[node_message("orders.k", {"seq": seq}, messageId=f"k-{seq}",
                                        headers={"kombu-events-key": "k"}) for seq in range(3)])
    wait_for(lambda: project.records(kind="start"), timeout=30, what="the first attempt begun")
    first.kill()
    project.worker(pool="prefork", concurrency=2).wait_ready()
    wait_for(lambda: len(project.records(kind="end")) >= 3, timeout=60, what="the three events handled")
    seen = [(r["kind"], r["seq"], r["attempt"]) for r in project.records()]
    assert seen == [("start", 0, 1),  # killed with its worker
                    ("start", 0, 1), ("failed", 0, 1), ("start", 0, 2), ("end", 0, 2),
                    ("start", 1, 1), ("end", 1, 1), ("start", 2, 1), ("end", 2, 1)]
