"""Changing an ordered handler's ``partitions=``: workers and ``declare`` refuse a new count over the old
partitions, and ``kombu-events migrate --partitions`` moves the waiting events over, counted, each key's in
order, with events still being published and retries still in the retry ladder."""
from __future__ import annotations

import collections
import json
import threading
import time
from typing import Any

import pytest
from celery import Celery

from kombu_events import Events

from .harness import node_message, peek_messages, queue_counts, run_cli, unique, wait_for

pytestmark = pytest.mark.integration

KEYS, PER_KEY = 20, 25
BACKOFF_S = 25  # a failed first attempt waits this long in the ladder: the move ends before it comes back

APP = """
events = Events(app, service=SERVICE, exchange=EXCHANGE, delay_unit_ms=100, delay_levels=9)

@events.handler("orders.#", bind=True, ordered_by="key", partitions=PARTITIONS, hold_failures=False,
                max_retries=3, backoff=Constant(every_ms=BACKOFF_MS))
def orders(event):
    seq = event.payload["seq"]
    record(kind="end", key=event.headers["kombu-events-key"], seq=seq, attempt=event.attempt)
    if FAIL and event.attempt == 1 and seq % 5 == 0:
        raise RuntimeError("first attempt fails")
"""


def projects(make_project, *counts: int, fail: bool = False) -> list[Any]:
    """One project per count of partitions, all of one service on one exchange (one app, redeployed)."""
    service, exchange = unique("svc"), unique("ex")
    body = APP.replace("FAIL", str(fail)).replace("BACKOFF_MS", str(BACKOFF_S * 1000))
    return [make_project(body.replace("PARTITIONS", str(n)), service=service,
                         exchange=exchange) for n in counts]


def partitions_of(broker_url: str, service: str) -> dict[str, list[tuple[str, int]]]:
    """Each partition queue of the service's handler: its waiting events as (key, seq), in queue order."""
    counts = queue_counts(broker_url)
    names = sorted(n for n in counts if n.startswith(f"{service}.orders.p"))
    return {name: [(m.headers["kombu-events-key"], json.loads(m.body)["seq"]) for m in peek_messages(broker_url, name)]
            for name in names}


def keys_in_order(partitions: dict[str, list[tuple[str, int]]]) -> dict[str, tuple[str, list[int]]]:
    """Each key's partition and its events' seqs in the order they wait; AssertionError if a key is in two."""
    found: dict[str, tuple[str, list[int]]] = {}
    for name, events in partitions.items():
        for key, seq in events:
            where, seqs = found.setdefault(key, (name, []))
            assert where == name, f"key {key} waits in {where} and in {name}"
            seqs.append(seq)
    return found


def publish(project: Any, seqs: range) -> None:
    project.node_publish(*[node_message(f"orders.k{key}", {"seq": seq}, headers={"kombu-events-key": f"k{key}"})
                           for seq in seqs for key in range(KEYS)])


def test_a_new_count_is_refused_until_migrate_moves_every_event_in_order(make_project, broker_url):
    four, six = projects(make_project, 4, 6)
    four.declare()
    publish(four, range(PER_KEY))
    before = keys_in_order(partitions_of(broker_url, four.service))
    assert sorted({where for where, _ in before.values()}) == [f"{four.service}.orders.p{i}" for i in range(4)]

    refused = run_cli(six, "declare")
    assert refused.returncode == 1, refused.stdout
    assert "has 4 partition queue(s) on the broker" in refused.stderr
    assert "500 event(s) waiting" in refused.stderr and "the app declares 6" in refused.stderr
    assert "kombu-events migrate --partitions" in refused.stderr
    worker = six.worker()
    assert worker.wait_exit(timeout=60) == 1, "the worker refuses to start over the old partitions"
    assert "kombu-events migrate --partitions" in worker.log

    dry = run_cli(six, "migrate", "--partitions", "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert "4 partition queue(s) on the broker, 500 event(s) waiting; the app declares 6" in dry.stdout
    assert "dry run: 21 step(s) would run:" in dry.stdout, dry.stdout
    assert sum(int(line.split("move the ")[1].split(" ")[0]) for line in dry.stdout.splitlines()
               if "move the " in line) == 500, "each partition's events, counted"
    assert keys_in_order(partitions_of(broker_url, four.service)) == before, "a dry run changes nothing"

    moved = run_cli(six, "migrate", "--partitions")
    assert moved.returncode == 0, moved.stderr + moved.stdout
    assert "moved" in moved.stdout and "500 event(s) from the partitions, 0 published meanwhile" in moved.stdout
    after = partitions_of(broker_url, six.service)
    assert sorted(after) == [f"{six.service}.orders.p{i}" for i in range(6)], "the new count, the holding queue gone"
    keys = keys_in_order(after)
    assert {key: seqs for key, (_, seqs) in keys.items()} == {f"k{k}": list(range(PER_KEY)) for k in range(KEYS)}
    assert len({where for where, _ in keys.values()}) >= 4, "the keys spread over the new partitions"
    assert run_cli(six, "migrate", "--partitions").stdout.count("nothing to do") == 1, "a second run has nothing to do"

    six.worker(pool="threads", concurrency=6).wait_ready()
    wait_for(lambda: len(six.records(kind="end")) >= KEYS * PER_KEY, timeout=120, interval=0.3,
             what="every event handled by the new count's worker")
    handled: dict[str, list[int]] = collections.defaultdict(list)
    for r in six.records(kind="end"):
        handled[r["key"]].append(r["seq"])
    assert handled == {f"k{k}": list(range(PER_KEY)) for k in range(KEYS)}, "each key in publish order, once"


def test_retries_in_the_ladder_for_a_dropped_partition_come_back_through_the_hash_exchange(make_project, broker_url):
    four, two = projects(make_project, 4, 2, fail=True)
    four.declare()
    worker = four.worker(pool="threads", concurrency=4).wait_ready()
    publish(four, range(10))  # 200 events; 40 fail their first attempt and wait in the ladder
    wait_for(lambda: len(four.records(kind="end")) >= KEYS * 10, timeout=60, interval=0.2, what="first attempts")
    failed_at = min(r["time"] for r in four.records(kind="end") if r["attempt"] == 1 and r["seq"] % 5 == 0)
    worker.stop()
    publish(four, range(10, 20))  # 200 more, waiting in the old partitions
    moved = run_cli(two, "migrate", "--partitions", timeout=120)
    assert moved.returncode == 0, moved.stderr + moved.stdout
    assert time.time() < failed_at + BACKOFF_S, "the move ended before the first retry came back from the ladder"
    assert "unbind partition" in moved.stdout and f"{two.service}.orders.p3, which goes" in moved.stdout

    two.worker(pool="threads", concurrency=2).wait_ready()
    expected = {(f"k{k}", seq) for k in range(KEYS) for seq in range(20)}

    def missing() -> set[tuple[str, int]]:
        return expected - _done_without_failing(four) - {(r["key"], r["seq"]) for r in two.records(kind="end")}

    try:
        wait_for(lambda: not missing(), timeout=60, interval=0.5, what="every event handled, the retries too")
    except AssertionError:
        raise AssertionError(f"not handled: {sorted(missing())}; {moved.stdout}; the broker holds "
                             f"{dict(queue_counts(broker_url))}") from None

    def retried() -> set[tuple[str, int]]:
        return {(r["key"], r["seq"]) for r in four.records(kind="end") + two.records(kind="end") if r["attempt"] == 2}

    failed = {(f"k{k}", seq) for k in range(KEYS) for seq in range(0, 20, 5)}
    wait_for(lambda: retried() >= failed, timeout=BACKOFF_S * 4, interval=0.5,
             what="every failed first attempt back from the ladder (through the hash exchange for a dropped partition)")
    assert retried() == failed
    counts = queue_counts(broker_url)
    assert sorted(n for n in counts if n.startswith(f"{two.service}.orders.")) == \
        [f"{two.service}.orders.p{i}" for i in range(2)], "the dropped partitions and the holding queue are gone"


def test_events_published_during_the_move_are_all_handled_in_order_but_the_switchs(make_project, broker_url):
    three, five = projects(make_project, 3, 5)
    three.declare()
    publish(three, range(PER_KEY))
    stop = threading.Event()
    published: list[int] = []

    def publish_meanwhile() -> None:
        events = Events(Celery("publisher", broker=broker_url), service="publisher", exchange=three.exchange)
        seq = 0
        while not stop.is_set() and seq < 4000:  # about 500 a second: one key, one partition, for the handler
            events.publish("orders.late", {"seq": seq}, key="late")
            published.append(seq)
            seq += 1
            time.sleep(0.002)

    publisher = threading.Thread(target=publish_meanwhile)
    publisher.start()
    try:
        wait_for(lambda: len(published) >= 200, timeout=30, what="the publisher publishing")
        moved = run_cli(five, "migrate", "--partitions", timeout=300)
    finally:
        stop.set()
        publisher.join()
    assert moved.returncode == 0, moved.stderr + moved.stdout

    five.worker(pool="threads", concurrency=5).wait_ready()
    wait_for(lambda: {r["seq"] for r in five.records(kind="end", key="late")} >= set(published), timeout=120,
             interval=0.5, what=f"the {len(published)} events published during the move, handled")
    wait_for(lambda: len(five.records(kind="end")) >= KEYS * PER_KEY + len(published), timeout=60, interval=0.5,
             what="every event handled")
    handled: dict[str, list[int]] = collections.defaultdict(list)
    for r in five.records(kind="end"):
        handled[r["key"]].append(r["seq"])
    late = handled.pop("late")
    assert handled == {f"k{k}": list(range(PER_KEY)) for k in range(KEYS)}, \
        f"the waiting events: in order, once: {dict(handled)} {moved.stdout}"
    switch = int(moved.stdout.rsplit("published meanwhile, ", 1)[1].split(" ", 1)[0])
    assert sorted(set(late)) == published, "every event published during the move, handled"
    out_of_order = sum(1 for a, b in zip(late, late[1:]) if b < a)
    assert out_of_order <= switch, f"only the events of the switch's instant may run late ({switch}): {late}"


def _done_without_failing(project: Any) -> set[tuple[str, int]]:
    """Events the first project's worker handled without failing before it stopped (a first attempt of a seq not
    divisible by 5, or a retry that came back in time)."""
    return {(r["key"], r["seq"]) for r in project.records(kind="end") if r["seq"] % 5 or r["attempt"] > 1}
