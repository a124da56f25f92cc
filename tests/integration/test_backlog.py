"""The publisher's backlog against a broker stopped and started for real (a private node: see private_broker.py).

Exact accounting by message id: every event published is delivered, in publish order;
duplicates only where the issue allows them (a flush killed between the confirm and
the delete). Each test prints its figures (run with -s to see them).
"""
from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import textwrap
import threading
import time
from collections import Counter

import pytest
from celery import Celery

from kombu_events import Backlog, Events
from kombu_events.core.breaker import CircuitBreaker

from .harness import ROOT, unique, wait_for

pytestmark = pytest.mark.integration

#: Probed after 0.2 s, then at most every 0.5 s: the tests wait for the flusher, not for a default 30 s.
FAST = CircuitBreaker(max_failures=1, max_unhealthy=1, reset_s=0.2, max_reset_s=0.5)

PUBLISHER = '''
import json, sys, time
from celery import Celery
from kombu_events import Backlog, Events
from kombu_events.core.breaker import CircuitBreaker

url, path, exchange, prefix, count, batch, start_at, stay, chunk = sys.argv[1:]
app = Celery("p" + prefix, broker=url)
events = Events(app, "svc" + prefix, exchange=exchange, backlog=Backlog(path, batch_size=int(batch)),
                publisher_circuit=CircuitBreaker(max_failures=1, max_unhealthy=1, reset_s=0.2, max_reset_s=0.5))
while time.time() < float(start_at):  # both processes start publishing at once
    time.sleep(0.001)
if chunk == "1":  # one by one, as a web app does
    results = [events.publish("bl.event", {"i": i}, message_id=f"{prefix}-{i}") for i in range(int(count))]
else:  # publish_many: one transaction per chunk, when the test only needs a full backlog quickly
    results = []
    for start in range(0, int(count), int(chunk)):
        results += events.publish_many([("bl.event", {"i": i}) for i in range(start, min(start + int(chunk),
                                                                                          int(count)))])
print(json.dumps({"stored": sum(r.stored_locally for r in results), "ids": results}), flush=True)
if stay == "stay":  # leave the daemon thread to flush once the broker is back
    time.sleep(3600)
'''


@pytest.fixture
def entities(private_broker):
    """A unique exchange and a queue bound to it with '#' (deleted after the test)."""
    exchange, queue = unique("ex"), unique("q")
    private_broker.declare(exchange, queue)
    yield exchange, queue
    if not private_broker.app_running:  # a test that failed while the node was stopped
        private_broker.start_app()
    private_broker.delete(exchange, queue)


@pytest.fixture
def make_events(private_broker, tmp_path):
    """``make_events(exchange)``: an Events publishing to the private node with a backlog in tmp_path."""
    made: list[Events] = []

    def make(exchange: str, policy: CircuitBreaker = FAST) -> Events:
        app = Celery(unique("app"), broker=private_broker.url)
        events = Events(app, unique("svc"), exchange=exchange, backlog=tmp_path / "backlog.sqlite3",
                        publisher_circuit=policy)
        made.append(events)
        return events

    yield make
    for events in made:
        assert events.publishing.backlog_publisher is not None
        events.publishing.backlog_publisher.stop()
        events.publishing.publisher.close()


def start_publisher(tmp_path, broker, exchange, prefix, count, *, batch=200, start_at=0.0, stay=False, chunk=1):
    script = tmp_path / "publisher.py"
    script.write_text(textwrap.dedent(PUBLISHER))
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    args = [broker.url, str(tmp_path / "backlog.sqlite3"), exchange, prefix, str(count), str(batch),
            str(start_at), "stay" if stay else "exit", str(chunk)]
    return subprocess.Popen([sys.executable, str(script), *args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def published(proc: subprocess.Popen) -> tuple[int, list[str]]:
    """How many events the publisher process stored locally, and every message id in publish order."""
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line, f"the publisher exited with {proc.wait()}: {proc.stderr.read() if proc.stderr else ''}"
    report = json.loads(line)
    return int(report["stored"]), list(report["ids"])


def flush_with_cli(tmp_path, broker) -> str:
    cli = [sys.executable, "-c", "from kombu_events.cli import main; main()"]
    result = subprocess.run([*cli, "--broker", broker.url, "backlog", "flush",
                             "--path", str(tmp_path / "backlog.sqlite3"), "--timeout", "60"],
                            env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def first_occurrences(ids: list[str]) -> list[str]:
    seen: set[str] = set()
    return [i for i in ids if not (i in seen or seen.add(i))]  # type: ignore[func-returns-value]


def test_broker_stopped_1000_publishes_are_stored_then_all_delivered_in_publish_order(
        private_broker, entities, make_events):
    exchange, queue = entities
    events = make_events(exchange)
    assert not events.publish("bl.warm", {}, message_id="warm").stored_locally, "the broker is up: confirmed"
    private_broker.stop_app()
    expected = [f"e-{i}" for i in range(1000)]
    started = time.perf_counter()
    results = [events.publish("bl.event", {"i": i}, message_id=mid) for i, mid in enumerate(expected)]
    took = time.perf_counter() - started
    assert all(r.stored_locally for r in results) and results == expected
    assert events.backlog is not None and events.backlog.status().depth == 1000
    back = time.perf_counter()
    starting = threading.Thread(target=private_broker.start_app)  # it serves AMQP before start_app returns
    starting.start()
    wait_for(lambda: events.backlog.status().depth == 0, timeout=60, what="the backlog drained")
    drained = time.perf_counter() - back
    starting.join(60)
    delivered = private_broker.drain(queue)
    assert delivered == ["warm", *expected], "every event once, in publish order"
    print(f"\n[backlog] broker down: 1000 publishes stored in {took:.2f} s ({took:.3f} ms each on average); "
          f"drained {drained:.2f} s after `start_app` was issued; delivered {len(delivered)}, order kept, "
          "lost 0, duplicates 0")


def test_kill_9_of_the_publishing_process_mid_flush_loses_nothing(private_broker, entities, tmp_path):
    exchange, queue = entities
    count, batch = 3000, 50
    private_broker.stop_app()
    proc = start_publisher(tmp_path, private_broker, exchange, "k", count, batch=batch, stay=True, chunk=100)
    try:
        stored, expected = published(proc)
        assert stored == count
        backlog = Backlog(tmp_path / "backlog.sqlite3")
        # The node serves AMQP before start_app returns: watch the backlog meanwhile.
        starting = threading.Thread(target=private_broker.start_app)
        starting.start()
        wait_for(lambda: backlog.status().depth < count // 2, timeout=30, interval=0.001, what="half flushed")
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
        starting.join(60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    left = backlog.status().depth
    assert 0 < left < count, f"killed mid-flush ({left} of {count} events still waiting)"
    output = flush_with_cli(tmp_path, private_broker)  # the restart: a flusher with nothing in memory
    assert backlog.status().depth == 0, output
    delivered = private_broker.drain(queue)
    duplicates = len(delivered) - len(set(delivered))
    assert set(delivered) == set(expected), f"lost: {sorted(set(expected) - set(delivered))[:10]}"
    assert first_occurrences(delivered) == expected, "publish order kept"
    assert duplicates <= batch, f"{duplicates} duplicates: more than the one batch in flight ({batch})"
    print(f"\n[backlog] kill -9 mid-flush with {left} of {count} waiting, then `backlog flush`: lost 0, "
          f"duplicates {duplicates} (batch {batch}), order kept")


def test_two_processes_publish_into_one_backlog_then_one_flush_delivers_each_event_once(
        private_broker, entities, tmp_path):
    exchange, queue = entities
    count = 500
    private_broker.stop_app()
    start_at = time.time() + 3.0  # after both have imported celery
    procs = [start_publisher(tmp_path, private_broker, exchange, prefix, count, start_at=start_at)
             for prefix in ("a", "b")]
    reports = [published(p) for p in procs]
    assert [p.wait(30) for p in procs] == [0, 0]
    assert [stored for stored, _ids in reports] == [count, count]
    assert [ids for _s, ids in reports] == [[f"{prefix}-{i}" for i in range(count)] for prefix in ("a", "b")]
    assert Backlog(tmp_path / "backlog.sqlite3").status().depth == 2 * count
    private_broker.start_app()
    flush_with_cli(tmp_path, private_broker)
    delivered = private_broker.drain(queue)
    counts = Counter(delivered)
    assert len(delivered) == 2 * count and set(counts.values()) == {1}, "every event exactly once"
    for prefix in ("a", "b"):
        mine = [i for i in delivered if i.startswith(prefix + "-")]
        assert mine == [f"{prefix}-{i}" for i in range(count)], f"process {prefix}'s order kept"
    interleaved = sum(1 for x, y in zip(delivered, delivered[1:]) if x[0] != y[0])
    print(f"\n[backlog] two processes x {count} into one backlog (interleaved {interleaved} times), one flush: "
          f"{len(delivered)} delivered, each once, each process's order kept")


def test_an_open_circuit_stores_without_waiting_and_closes_once_the_broker_answers(
        private_broker, entities, make_events):
    exchange, queue = entities
    events = make_events(exchange, CircuitBreaker(max_failures=1, max_unhealthy=1, reset_s=1.0, max_reset_s=1.0))
    closed_up = [_timed(events, f"up-{i}") for i in range(50)]
    assert not any(stored for stored, _t in closed_up)
    events.publishing.publisher.close()  # the next publish has to connect, as after a restart
    private_broker.stop_app()
    first_stored, first = _timed(events, "down-0")
    rest = [_timed(events, f"down-{i}") for i in range(1, 200)]
    assert first_stored and all(stored for stored, _t in rest)
    open_latencies = [t for _s, t in rest]
    assert statistics.median(open_latencies) < 0.05 and max(open_latencies) < first, (first, max(open_latencies))
    private_broker.start_app()
    outbox = events.publishing.backlog_publisher
    assert outbox is not None
    wait_for(lambda: outbox.breakers.closed() and events.backlog.status().depth == 0, timeout=30,
             what="the broker's health check passed, the circuit closed and the backlog drained")
    after_stored, after = _timed(events, "after")
    assert not after_stored, "the circuit is closed again: published directly"
    delivered = private_broker.drain(queue)
    assert delivered == [f"up-{i}" for i in range(50)] + [f"down-{i}" for i in range(200)] + ["after"]
    closed_ms = statistics.median(t for _s, t in closed_up) * 1000
    print(f"\n[backlog] publish latency: circuit closed, broker up {closed_ms:.2f} ms (median of 50); "
          f"broker down, circuit closed (the publish that trips it) {first * 1000:.0f} ms; circuit open "
          f"{statistics.median(open_latencies) * 1000:.2f} ms median, {max(open_latencies) * 1000:.1f} ms max "
          f"(publishes 2..200); after the broker is back, closed again: {after * 1000:.2f} ms")


def _timed(events: Events, message_id: str) -> tuple[bool, float]:
    started = time.perf_counter()
    result = events.publish("bl.event", {"id": message_id}, message_id=message_id)
    return result.stored_locally, time.perf_counter() - started
