"""The gevent and eventlet pools: real `celery worker --with-events-step -P gevent|eventlet -c 50` subprocesses.

Under these pools handlers run in greenlets of the worker's main process, Celery runs its
blocking loop instead of an event loop, and ``time.sleep`` is monkeypatched, so a
sleeping handler yields to the others. One worker per pool serves the concurrency, retry
and task tests (module-scoped, parametrized by pool); the shutdown test has a worker of its
own, since it ends it, and so has each start-up refusal of an ``async def`` handler. Events
are published by Python (``Events.publish_many``).
"""
from __future__ import annotations

import importlib.util
import json
import os
import signal
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

from .harness import Project, Worker, get_messages, queue_counts, wait_for

pytestmark = pytest.mark.integration

POOLS = ["gevent", "eventlet"]
CONCURRENCY = 50
SLEEP_S = 0.5
N = 100
SERIAL_S = N * SLEEP_S

RETRY_MS = 200

APP = f"""
RETRY_MS = {RETRY_MS}
STOP = RECORDS + ".stop"
events = Events(app, service=SERVICE, exchange=EXCHANGE, delay_unit_ms=100, delay_levels=4)

@app.task
def ping():
    record(what="task")

@events.handler("green.sleep")
def sleepy(payload):
    record(what="start", id=payload["id"])
    time.sleep(payload.get("sleep", {SLEEP_S}))
    record(what="end", id=payload["id"])

@events.handler("green.until_stop")
def until_stop(payload):
    # Sleeps until the test has sent SIGTERM (it then writes STOP), and 1 s more: in flight for sure.
    record(what="start", id=payload["id"])
    deadline = time.time() + 20
    while not os.path.exists(STOP) and time.time() < deadline:
        time.sleep(0.05)
    time.sleep(1.0)
    record(what="end", id=payload["id"], after_stop=os.path.exists(STOP))

def task_ran():
    with open(RECORDS) as fh:
        return '"what": "task"' in fh.read()

@events.handler("green.until_task")
def until_task(payload):
    record(what="waiting", id=payload["id"])
    deadline = time.time() + 10
    while not task_ran() and time.time() < deadline:
        time.sleep(0.05)
    record(what="waited", id=payload["id"], saw_task=task_ran())

@events.handler("green.flaky", bind=True, backoff=Constant(every_ms=RETRY_MS))
def flaky(event):
    record(what="flaky", id=event.payload["id"], attempt=event.attempt)
    if event.attempt == 1:
        raise RuntimeError("fails on its first attempt")
"""


def require(pool: str) -> None:
    """Skip without the pool's library (pip install -e '.[test]' has it); fail under CI=true.

    Looked up, not imported: importing eventlet or gevent into the test process could patch it.
    """
    if importlib.util.find_spec(pool) is None:
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(f"{pool} is not installed (CI=true: must not skip)")
        pytest.skip(f"{pool} is not installed (pip install -e '.[test]')")


def publish(project: Project, *items: tuple[str, dict[str, Any]]) -> None:
    """Publish ``(routing_key, payload)`` events through the project's own ``events``."""
    result = project.run_python(f"""
        from {project.module} import events
        events.publish_many({list(items)!r})
    """)
    assert result.returncode == 0, result.stderr


def service_counts(project: Project) -> dict[str, tuple[int, int, int]]:
    """{queue: (ready, unacknowledged, consumers)} for every queue of the project's service."""
    return {name: counts for name, counts in queue_counts(project.broker_url).items()
            if name.startswith(project.service + ".")}


@pytest.fixture(scope="module", params=POOLS)
def green(request, tmp_path_factory, broker_url) -> Iterator[tuple[Project, Worker]]:
    """A project and its worker under ``-P <pool> -c 50``, shared by the tests of one pool."""
    pool = request.param
    require(pool)
    project = Project(tmp_path_factory.mktemp(pool), broker_url, APP)
    try:
        worker = project.worker(pool=pool, concurrency=CONCURRENCY).wait_ready()
        assert f"concurrency: {CONCURRENCY} ({pool})" in worker.log, worker.log[-3000:]
        yield project, worker
    finally:
        project.cleanup()


def test_sleeping_handlers_run_concurrently_each_event_once(green):
    project, worker = green
    ids = [f"c{i}" for i in range(N)]
    started = time.time()
    publish(project, *(("green.sleep", {"id": i}) for i in ids))

    wait_for(lambda: len(project.records(what="end")) >= N, timeout=SERIAL_S / 4,
             what=f"{N} handlers of {SLEEP_S} s in under a quarter of the serial {SERIAL_S} s")
    elapsed = time.time() - started
    wait_for(lambda: project.settled("sleepy"), timeout=5, what="every event acked")
    ends = [r for r in project.records(what="end") if r["id"] in ids]
    assert sorted(r["id"] for r in ends) == sorted(ids), "each event handled exactly once"
    assert {r["pid"] for r in ends} == {worker.proc.pid}, "greenlets of the worker's main process"
    # How many ran at once: at most -c, and far more than one (the bound is loose for a busy machine).
    starts = [r for r in project.records(what="start") if r["id"] in ids]
    moments = sorted([(r["time"], 1) for r in starts] + [(r["time"], -1) for r in ends])
    running = peak = 0
    for _when, step in moments:
        running += step
        peak = max(peak, running)
    assert 10 <= peak <= CONCURRENCY, f"{peak} handlers at once with -c {CONCURRENCY}"
    print(f"{N} events x {SLEEP_S} s: {elapsed:.2f} s (serial {SERIAL_S:.0f} s), {peak} at once")


def test_a_failed_first_attempt_is_retried_through_the_delay_ladder(green):
    project, worker = green
    publish(project, ("green.flaky", {"id": "r1"}))

    wait_for(lambda: len(project.records(what="flaky", id="r1")) >= 2, timeout=10, what="the second attempt")
    time.sleep(0.3)  # no third attempt may come
    calls = project.records(what="flaky", id="r1")
    assert [c["attempt"] for c in calls] == [1, 2]
    assert calls[1]["time"] - calls[0]["time"] >= RETRY_MS / 1000 - 0.05, "the retry waited for its delay"
    retried = [line for line in worker.log.splitlines() if "outcome=retry" in line and "green.flaky" in line]
    assert len(retried) == 1 and f"delay_ms={RETRY_MS}" in retried[0], worker.log[-3000:]
    # Acked, and nothing left in a delay queue or the archive.
    wait_for(lambda: all(ready == unacked == 0 for ready, unacked, _ in service_counts(project).values()),
             timeout=5, what="every queue of the service empty")


def test_a_task_runs_while_event_handlers_wait_for_it(green):
    """Each handler sleeps until the task has run (10 s at most): the task must run beside them."""
    project, worker = green
    ids = [f"t{i}" for i in range(3)]
    publish(project, *(("green.until_task", {"id": i}) for i in ids))
    wait_for(lambda: len(project.records(what="waiting")) == 3, what="the handlers waiting")
    project.send_task("ping")

    wait_for(lambda: len(project.records(what="waited")) == 3, timeout=15, what="the handlers")
    assert [r["saw_task"] for r in project.records(what="waited")] == [True] * 3, "the task waited for the handlers"
    (task,) = project.records(what="task")
    assert task["pid"] == worker.proc.pid
    wait_for(lambda: project.settled("until_task"), timeout=5, what="the events acked")


SHUTDOWN_N = 200


@pytest.mark.parametrize("pool", POOLS)
def test_sigterm_with_handlers_in_flight_loses_nothing(make_project, pool):
    """Every event ends either handled and acked, or back in its queue: never both, never neither."""
    require(pool)
    project = make_project(APP.replace("delay_levels=4", f"delay_levels=4, prefetch_count={CONCURRENCY}"))
    worker = project.worker(pool=pool, concurrency=CONCURRENCY).wait_ready()
    publish(project, *(("green.until_stop", {"id": i}) for i in range(SHUTDOWN_N)))
    wait_for(lambda: len(project.records(what="start")) >= CONCURRENCY, what=f"{CONCURRENCY} handlers in flight")
    in_flight = {r["id"] for r in project.records(what="start")}
    signalled = time.time()
    worker.proc.send_signal(signal.SIGTERM)
    Path(f"{project.records_path}.stop").touch()  # the handlers end 1 s from now, during the warm shutdown
    assert worker.wait_exit(timeout=30) == 0, worker.log[-3000:]

    ends = project.records(what="end")
    handled = [r["id"] for r in ends]
    assert all(r["after_stop"] for r in ends), "a handler ended before SIGTERM"
    assert in_flight <= set(handled), f"in flight at SIGTERM, never finished: {sorted(in_flight - set(handled))}"
    counts = service_counts(project)
    queue = f"{project.service}.until_stop"
    assert counts[queue][1:] == (0, 0), f"nothing unacked, no consumer left: {counts[queue]}"
    assert all(ready == unacked == 0 for name, (ready, unacked, _) in counts.items() if name != queue), \
        f"nothing retried or archived: {counts}"
    left = [json.loads(m.body)["id"] for m in get_messages(project.broker_url, queue)]
    assert len(handled) == len(set(handled)), "an event handled twice"
    assert not set(handled) & set(left), f"handled but not acked: {sorted(set(handled) & set(left))}"
    assert sorted(handled + left) == list(range(SHUTDOWN_N)), "an event lost"
    assert left, "every event was handled: the test did not stop the worker with events still queued"
    assert "Traceback" not in worker.log, worker.log[-3000:]
    print(f"{pool}: {len(in_flight)} in flight at SIGTERM, {len(handled)} handled, {len(left)} left in the "
          f"queue, stopped in {time.time() - signalled:.1f} s")


ASYNC_APP = """
import asyncio

events = Events(app, service=SERVICE, exchange=EXCHANGE)

@events.handler("green.plain")
def plain(payload):
    record(what="plain")

@events.handler("green.awaiting")
async def awaiting(payload):
    await asyncio.sleep(0)
    record(what="awaited")
"""


@pytest.mark.parametrize("pool", POOLS)
def test_an_async_def_handler_is_refused_at_start_up(make_project, pool):
    """No asyncio loop runs in a greenlet worker: it says so and exits, before it consumes anything."""
    require(pool)
    project = make_project(ASYNC_APP)
    worker = project.worker(pool=pool, concurrency=CONCURRENCY)
    wait_for(lambda: worker.proc.poll() is not None or " ready." in worker.log, timeout=30, what="exit or ready")
    assert worker.proc.poll() == 1, worker.log[-3000:]

    errors = [line for line in worker.log.splitlines() if "ERROR" in line]
    assert len(errors) == 1, worker.log[-3000:]
    assert f"{project.service} has async def handlers (awaiting)" in errors[0]
    assert f"the {pool} pool" in errors[0] and "--pool=prefork" in errors[0]
    assert "consuming" not in worker.log
