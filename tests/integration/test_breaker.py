"""A handler's circuit breaker in a real prefork worker: it trips, its queue waits with no consumer while the
rest of the worker goes on, a health check keeps it open, and after recovery every event is handled once with
no attempt spent by the pause."""
from __future__ import annotations

import json
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import pytest

from .harness import publish_amqp, queue_depth, run_cli, wait_for

pytestmark = pytest.mark.integration

EVENTS = 30

PROJECT = """
from kombu_events import signals

DOWN = RECORDS + ".down"            # the payment API is down while this file exists
UNHEALTHY = RECORDS + ".unhealthy"  # its health check says Unhealthy while this file exists

events = Events(app, service=SERVICE, exchange=EXCHANGE, delay_unit_ms=100, delay_levels=8, prefetch_count=4,
                backoff=Constant(300))

@events.handler("pay.#", bind=True,
                circuit_breaker=CircuitBreaker(max_failures=3, window_s=10, reset_s=1.5, max_reset_s=3))
def pay(event):
    down = os.path.exists(DOWN)
    record(handler="pay", id=event.message_id, attempt=event.attempt, ok=not down)
    time.sleep(0.02)
    if down:
        raise ConnectionError("payment API: connection refused")

@events.handler("audit.#", bind=True)
def audit(event):
    record(handler="audit", id=event.message_id)

@events.health_check(pay, interval_s=0.5, timeout_s=2)
def payment_api():
    return Unhealthy("payment API flagged") if os.path.exists(UNHEALTHY) else Healthy()

@app.task
def ping():
    record(task="ping")

@signals.circuit_changed.connect
def changed(sender, queue, state, previous, reason, **kwargs):
    record(circuit=state, previous=previous, reason=reason, sender=sender.__name__, queue=queue)
"""


class Timeline:
    """Samples (seconds since start, circuit state, ready messages, consumers, handled) every 0.25 s,
    and what the test did when (``mark``)."""

    def __init__(self, project: Any, queue: str) -> None:
        self.project, self.queue, self.rows = project, queue, []
        self.marks: list[tuple[float, str]] = []
        self.start = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.25):
            changes = self.project.records(sender="pay")
            ready, consumers = queue_depth(self.project.broker_url, self.queue)
            handled = len({r["id"] for r in self.project.records(handler="pay", ok=True)})
            self.rows.append((round(time.monotonic() - self.start, 2), changes[-1]["circuit"] if changes else "closed",
                              ready, consumers, handled))

    def mark(self, what: str) -> None:
        self.marks.append((round(time.monotonic() - self.start, 2), what))

    def stop(self) -> list[str]:
        """The samples where something changed, with the marks, as lines."""
        self._stop.set()
        self._thread.join()
        lines, last = [], None
        for row in self.rows:
            if row[1:] != last:
                lines.append((row[0], f"{row[0]:<6} {row[1]:<10} {row[2]:>5} {row[3]:>9} {row[4]:>7}"))
            last = row[1:]
        lines += [(t, f"{t:<6} -- {what}") for t, what in self.marks]
        return ["t_s    state      ready consumers handled"] + [line for _t, line in sorted(lines)]


@pytest.mark.parametrize("pool, concurrency", [("prefork", 2), ("threads", 2), ("solo", 1)])
def test_a_tripped_breaker_pauses_its_queue_only_and_recovers_with_every_event_handled_once(make_project, pool,
                                                                                           concurrency):
    project = make_project(PROJECT)
    down, unhealthy = Path(f"{project.records_path}.down"), Path(f"{project.records_path}.unhealthy")
    down.touch()
    worker = project.worker(pool=pool, concurrency=concurrency).wait_ready()
    pay_queue, archive = f"{project.service}.pay", f"{project.service}.archive"
    wait_for(lambda: queue_depth(project.broker_url, pay_queue)[1] == 1, what="pay consumed")
    timeline = Timeline(project, pay_queue)

    def publish(key: str, n: int) -> None:
        publish_amqp(project.broker_url, project.exchange, key, json.dumps({"n": n}).encode(),
                     content_type="application/json", message_id=f"{key}-{n}")

    timeline.mark(f"publishing {EVENTS} pay events (the payment API is down)")
    for n in range(EVENTS):
        publish("pay.x", n)
    [opened] = wait_for(lambda: project.records(circuit="open"), what="the circuit trips")
    unhealthy.touch()  # before its first reset time (1.5 s): the health check keeps it open from now on
    timeline.mark("circuit open seen; health check made Unhealthy")
    assert opened["previous"] == "closed" and opened["reason"] == "3 failures within 10 s"

    # Open: no consumer on the pay queue, its events wait there; the other handler and tasks go on.
    assert wait_for(lambda: queue_depth(project.broker_url, pay_queue)[1] == 0, what="pay consumer cancelled")
    for n in range(5):
        publish("audit.x", n)
    project.send_task("ping")
    wait_for(lambda: len(project.records(handler="audit")) == 5 and project.records(task="ping"),
             what="the audit handler and a Celery task run while the circuit is open")
    timeline.mark("5 audit events and a Celery task handled meanwhile")
    status = run_cli(project, "status")
    assert status.returncode == 0, status.stderr
    assert any(line.startswith(pay_queue) and line.endswith("PAUSED (no consumer)")
               for line in status.stdout.splitlines()), status.stdout
    assert f"handler queue {pay_queue} has no consumer" in status.stderr
    rows = {r["queue"]: r for r in json.loads(run_cli(project, "status", "--json").stdout)}
    assert rows[pay_queue]["state"] == "paused" and rows[f"{project.service}.audit"]["state"] == "consuming"

    # Unhealthy keeps it open across reset times: no probe, the events stay in the queue.
    calls_when_open = len(project.records(handler="pay"))
    time.sleep(4.0)
    assert [r["circuit"] for r in project.records(sender="pay")] == ["open"]
    assert "stays open: health check payment_api: unhealthy: payment API flagged" in worker.log
    assert len(project.records(handler="pay")) == calls_when_open, "no handler call while open"
    waiting, consumers = queue_depth(project.broker_url, pay_queue)
    assert consumers == 0 and waiting > 0

    # Recovery: the health check passes, one probe succeeds, the circuit closes and the queue drains.
    unhealthy.unlink()
    down.unlink()
    timeline.mark("payment API back, health check Healthy")
    wait_for(lambda: project.records(circuit="closed"), timeout=10, what="the circuit closes")
    wait_for(lambda: len({r["id"] for r in project.records(handler="pay", ok=True)}) == EVENTS, timeout=20,
             what="every pay event handled")
    wait_for(lambda: project.settled("pay"), what="the pay queue drained")
    timeline.mark("every pay event handled, queue drained")
    lines = timeline.stop()
    assert [r["circuit"] for r in project.records(sender="pay")] == ["open", "half_open", "closed"]
    assert queue_depth(project.broker_url, pay_queue)[1] == 1, "consumed again"

    # Exact accounting by message id: none lost, none archived, no attempt spent but by a real failed call.
    calls: dict[str, list[dict]] = defaultdict(list)
    for r in project.records(handler="pay"):
        calls[r["id"]].append(r)
    assert sorted(calls) == sorted(f"pay.x-{n}" for n in range(EVENTS))
    for message_id, seen in calls.items():
        assert [r["attempt"] for r in seen] == list(range(1, len(seen) + 1)), (message_id, seen)
        assert [r["ok"] for r in seen] == [False] * (len(seen) - 1) + [True], (message_id, seen)
    assert queue_depth(project.broker_url, archive)[0] == 0, "nothing archived"
    assert "redelivered" not in worker.log, "pausing and resuming made the broker redeliver nothing"
    assert "having no callbacks" not in worker.log, "py-amqp rejected no delivery for a cancelled consumer"
    deferred = [line for line in worker.log.splitlines() if "outcome=requeue" in line]
    assert all("reason='circuit open" in line and "attempt=1 " in line for line in deferred), deferred
    failed = Counter(len(seen) - 1 for seen in calls.values())
    # 3 failures trip it; handler calls already running then (at most the pool's concurrency) may fail too, and
    # the failed probe once: what was merely waiting in the pool is deferred there, never run against the outage.
    assert sum(len(seen) - 1 for seen in calls.values()) <= 3 + concurrency + 1, dict(failed)
    print(f"\n{pool}: failed calls per message: {dict(sorted(failed.items()))}; "
          f"handler calls: {sum(len(s) for s in calls.values())}; deferred while open: {len(deferred)}")
    print("\n".join(lines))
    assert failed[0] >= EVENTS - 10, "most events never reached the handler while it was down"
