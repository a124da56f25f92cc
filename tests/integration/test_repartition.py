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
events = Events(app, service=SERVICE, exchange=EXCHANGE, delay_unit_ms=100, delay_levels=9, queue_type=QUEUE_TYPE)

@events.handler("orders.#", bind=True, ordered_by=ORDERED_BY, partitions=PARTITIONS, hold_failures=False,
                max_retries=3, backoff=Constant(every_ms=BACKOFF_MS))
def orders(event):
    seq = event.payload["seq"]
    record(kind="end", key=event.headers["kombu-events-key"], seq=seq, attempt=event.attempt, queue=event.queue)
    if FAIL and event.attempt == 1 and seq % 5 == 0:
        raise RuntimeError("first attempt fails")
"""


def projects(make_project, *counts: int, fail: bool = False, ordered_by: str = "key",
             queue_type: str = "classic") -> list[Any]:
    """One project per count of partitions, all of one service on one exchange (one app, redeployed)."""
    service, exchange = unique("svc"), unique("ex")
    body = (APP.replace("FAIL", str(fail)).replace("BACKOFF_MS", str(BACKOFF_S * 1000))
            .replace("ORDERED_BY", repr(ordered_by)).replace("QUEUE_TYPE", repr(queue_type)))
    if queue_type == "quorum":  # the library refuses quorum events beside a classic task queue
        body = "app.conf.task_default_queue_type = 'quorum'\n" + body
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


def exactly_once(handled: list[Any]) -> None:
    """AssertionError naming each item handled more than once."""
    twice = {item: n for item, n in collections.Counter(handled).items() if n != 1}
    assert not twice, f"handled more than once: {twice}"


@pytest.mark.parametrize("queue_type", ["classic", "quorum"])
def test_a_new_count_is_refused_until_migrate_moves_every_event_in_order(make_project, broker_url, queue_type):
    four, six = projects(make_project, 4, 6, queue_type=queue_type)
    four.declare()
    publish(four, range(PER_KEY))
    peekable = queue_type == "classic"  # basic.get: a quorum queue with a single active consumer refuses it
    before = keys_in_order(partitions_of(broker_url, four.service)) if peekable else {}
    assert not peekable or sorted({where for where, _ in before.values()}) == \
        [f"{four.service}.orders.p{i}" for i in range(4)]

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
    assert "dry run: 23 step(s) would run:" in dry.stdout, dry.stdout
    assert sum(int(line.split("move the ")[1].split(" ")[0]) for line in dry.stdout.splitlines()
               if "move the " in line) == 500, "each partition's events, counted"
    assert not peekable or keys_in_order(partitions_of(broker_url, four.service)) == before, "a dry run: no change"

    moved = run_cli(six, "migrate", "--partitions")
    assert moved.returncode == 0, moved.stderr + moved.stdout
    assert "moved" in moved.stdout and "500 event(s) from the partitions, 0 published meanwhile" in moved.stdout
    assert "counted 500 event(s) waiting in the partitions, staged 500; 500 staged in all, sent 500" in moved.stdout
    assert "mismatch" not in moved.stderr, moved.stderr
    assert sorted(n for n in queue_counts(broker_url) if n.startswith(f"{six.service}.orders.")) == \
        [f"{six.service}.orders.p{i}" for i in range(6)], "the new count, the queues of the move gone"
    wait_for(lambda: sum(queue_counts(broker_url)[f"{six.service}.orders.p{i}"][0] for i in range(6)) == KEYS * PER_KEY,
             timeout=10, interval=0.5, what=f"every event in the new partitions: {moved.stdout}")
    if peekable:
        keys = keys_in_order(partitions_of(broker_url, six.service))
        assert {key: seqs for key, (_, seqs) in keys.items()} == {f"k{k}": list(range(PER_KEY)) for k in range(KEYS)}
    assert run_cli(six, "migrate", "--partitions").stdout.count("nothing to do") == 1, "a second run has nothing to do"

    six.worker(pool="threads", concurrency=6).wait_ready()
    wait_for(lambda: len(six.records(kind="end")) >= KEYS * PER_KEY, timeout=120, interval=0.3,
             what="every event handled by the new count's worker")
    handled: dict[str, list[int]] = collections.defaultdict(list)
    for r in six.records(kind="end"):
        handled[r["key"]].append(r["seq"])
    exactly_once([(r["key"], r["seq"]) for r in six.records(kind="end")])
    assert handled == {f"k{k}": list(range(PER_KEY)) for k in range(KEYS)}, "each key in publish order, once"
    where = {key: {r["queue"] for r in six.records(kind="end", key=key)} for key in handled}
    assert all(len(queues) == 1 for queues in where.values()), f"each key in one partition: {where}"
    assert len(set().union(*where.values())) >= 4, "the keys spread over the new partitions"


@pytest.mark.parametrize("ordered_by", ["key", "routing_key"])
def test_retries_in_the_ladder_for_a_dropped_partition_reach_their_keys_partition_then_the_bridge_goes(
        make_project, broker_url, ordered_by):
    four, two = projects(make_project, 4, 2, fail=True, ordered_by=ordered_by)
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
    bridge = f"{two.service}.orders.repartitioning.returns"
    assert f"{bridge} stays" in moved.stderr, "retries wait in the ladder: the way back stays"

    two.worker(pool="threads", concurrency=2).wait_ready()
    wait_for(lambda: len([r for r in two.records(kind="end") if r["attempt"] == 1]) >= KEYS * 10, timeout=60,
             interval=0.5, what="the first attempts of the events that waited (seq 10 and 15 fail too)")
    failures = [r["time"] for r in four.records(kind="end") + two.records(kind="end")
                if r["attempt"] == 1 and r["seq"] % 5 == 0]
    time.sleep(max(0.0, max(failures) + BACKOFF_S + 3 - time.time()))  # every retry out of the ladder
    again = run_cli(two, "migrate", "--partitions", timeout=120)  # the workers run: only the bridge is dealt with
    assert again.returncode == 0, again.stderr + again.stdout
    assert bridge not in queue_counts(broker_url), f"the bridge is deleted once the ladder is empty: {again.stdout}"
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
    wait_for(lambda: retried() >= failed, timeout=30, interval=0.5, what="every failed first attempt retried")
    records = four.records(kind="end") + two.records(kind="end")
    exactly_once([(r["key"], r["seq"], r["attempt"]) for r in records])
    dropped = {r["key"] for r in four.records(kind="end") if r["queue"].endswith((".p2", ".p3"))}
    assert dropped, "some keys were in a dropped partition"
    spread = {key: sorted({r["queue"] for r in two.records(kind="end", key=key)}) for key in dropped}
    assert all(len(queues) == 1 for queues in spread.values()), f"a key's events and retries in one partition: {spread}"
    counts = queue_counts(broker_url)
    assert sorted(n for n in counts if n.startswith(f"{two.service}.orders.")) == \
        [f"{two.service}.orders.p{i}" for i in range(2)], "the dropped partitions and the queues of the move are gone"


def test_a_partition_declared_again_while_the_bridge_stays_gets_each_retry_once(make_project, broker_url):
    four, two, four_again = projects(make_project, 4, 2, 4, fail=True)
    four.declare()
    worker = four.worker(pool="threads", concurrency=4).wait_ready()
    publish(four, range(10))  # 40 fail their first attempt and wait in the ladder, addressed to p0 .. p3
    wait_for(lambda: len(four.records(kind="end")) >= KEYS * 10, timeout=60, interval=0.2, what="first attempts")
    failed_at = min(r["time"] for r in four.records(kind="end") if r["attempt"] == 1 and r["seq"] % 5 == 0)
    worker.stop()
    down = run_cli(two, "migrate", "--partitions", timeout=120)
    assert down.returncode == 0 and "stays" in down.stderr, down.stderr + down.stdout
    up = run_cli(four_again, "migrate", "--partitions", timeout=120)  # p2 and p3 again, their retries still due
    assert up.returncode == 0, up.stderr + up.stdout
    assert time.time() < failed_at + BACKOFF_S, "both moves ended before the first retry came back from the ladder"
    assert f"unbind {four.service}.orders.repartitioning.returns for partition {four.service}.orders.p3" in up.stdout

    four_again.worker(pool="threads", concurrency=4).wait_ready()
    failed = {(f"k{k}", seq) for k in range(KEYS) for seq in range(0, 10, 5)}

    def retried() -> set[tuple[str, int]]:
        return {(r["key"], r["seq"]) for r in four_again.records(kind="end") if r["attempt"] == 2}

    wait_for(lambda: retried() >= failed, timeout=BACKOFF_S * 3, interval=0.5, what="every retry back")
    time.sleep(2)  # a retry that reached its partition twice would run twice by now
    records = four.records(kind="end") + four_again.records(kind="end")
    exactly_once([(r["key"], r["seq"], r["attempt"]) for r in records])


def test_a_run_stopped_while_routing_is_finished_by_the_next_with_each_key_in_order_once(make_project, broker_url):
    four, six = projects(make_project, 4, 6)
    four.declare()
    publish(four, range(PER_KEY))
    stopped = six.run_python(f"""
        import sys
        from kombu_events.cli import main
        from kombu_events.ops import repartition
        through = repartition._through

        def one_batch_then_die(connection, source, exchange, until=None):
            if not source.endswith(".repartitioning.old"):
                return through(connection, source, exchange, until=until)
            batches = iter([False])
            through(connection, source, exchange, until=lambda: next(batches, True))
            sys.exit(3)

        repartition._through = one_batch_then_die
        sys.argv = ["kombu-events", "-A", {six.module!r}, "migrate", "--partitions"]
        main()
    """, timeout=120)
    assert stopped.returncode == 3, stopped.stderr + stopped.stdout
    counts = queue_counts(broker_url)
    assert counts[f"{six.service}.orders.repartitioning.old"][0] == KEYS * PER_KEY - 200, "one batch routed"
    assert f"{six.service}.orders.repartitioning.routing" in counts

    finished = run_cli(six, "migrate", "--partitions", timeout=120)
    assert finished.returncode == 0, finished.stderr + finished.stdout
    assert "move the" not in finished.stdout, "nothing staged again before what is left is routed"
    after = partitions_of(broker_url, six.service)
    assert sorted(after) == [f"{six.service}.orders.p{i}" for i in range(6)]
    exactly_once([item for events in after.values() for item in events])
    keys = keys_in_order(after)
    assert {key: seqs for key, (_, seqs) in keys.items()} == {f"k{k}": list(range(PER_KEY)) for k in range(KEYS)}


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
    exactly_once([(key, seq) for key, seqs in handled.items() for seq in seqs])
    twice = {seq: n for seq, n in collections.Counter(late).items() if n != 1}
    # An event published in the instant a binding changes (hold, switch) reaches both places: at least once.
    assert len(twice) <= 4 and set(twice.values()) <= {2}, f"duplicates beyond the binding changes: {twice}"
    assert handled == {f"k{k}": list(range(PER_KEY)) for k in range(KEYS)}, \
        f"the waiting events: in order, once: {dict(handled)} {moved.stdout}"
    switch = int(moved.stdout.rsplit("published meanwhile, ", 1)[1].split(" ", 1)[0])
    assert sorted(collections.Counter(late)) == published, "every event published during the move, handled"
    out_of_order = sum(1 for a, b in zip(late, late[1:]) if b < a)
    assert out_of_order <= switch, f"only the events of the switch's instant may run late ({switch}): {late}"


def _done_without_failing(project: Any) -> set[tuple[str, int]]:
    """Events the first project's worker handled without failing before it stopped (a first attempt of a seq not
    divisible by 5, or a retry that came back in time)."""
    return {(r["key"], r["seq"]) for r in project.records(kind="end") if r["seq"] % 5 or r["attempt"] > 1}
