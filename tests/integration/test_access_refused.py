"""ACCESS_REFUSED at run time, on a vhost of the test's own: a least-privilege worker (``--events-no-declare``)
whose user loses a permission while it runs.

- *write* on the delay exchanges: the retry it republishes is refused; the original is not acked, the
  handler queue is paused (no spinning), one ERROR line names the permission; the worker keeps running.
- *write* on the archive: the same, for a message it archives.
- *write* on the events exchange: the handler's own ``events.publish`` raises a PublishError naming the
  permission; the event takes its usual retry/archive path; the worker's channels are unharmed.
- *read* on a handler queue, seen after a reconnect: the worker stops with exit 1 and one line.

Every message is counted before and after (rabbitmqctl): none lost, none handled in a loop.
"""
from __future__ import annotations

import re
import time
import uuid

import pytest

from ..brokers import amqp_url
from .harness import Project, ctl, own_vhost, purge_archive, queue_counts, run_cli, wait_for
from .test_least_privilege import apply, runtime_line, url

BODY = """
events = Events(app, service=SERVICE, exchange=EXCHANGE, delay_levels=3, delay_unit_ms=100, max_retries=2)

@events.handler("ar.retry", bind=True)
def retrying(event):
    record(handler="retry", attempt=event.attempt)
    raise RuntimeError("retry me")

@events.handler("ar.archive")
def archiving(payload):
    record(handler="archive")
    raise Archive("hopeless")

@events.handler("ar.publish")
def publishing(payload):
    try:
        events.publish("ar.sink", {"from": "handler"})
    except Exception as exc:
        record(handler="publish", error=f"{type(exc).__name__}: {exc}")
        raise
    record(handler="publish", error=None)

@events.handler("ar.sink")
def sink(payload):
    record(handler="sink")
"""


@pytest.fixture
def vhost(broker_url):
    """A vhost with a runtime user (no permissions yet); guest declares and inspects. Deleted after."""
    with own_vhost("kev-ar", runtime="kev-ar-run") as found:
        yield found


def without(regex: str, name: str) -> str:
    """``regex`` (anchored, as `kombu-events permissions` prints it) that no longer matches names starting with
    ``name`` (a trailing ``$`` in ``name``: exactly ``name``); RabbitMQ's regexes are PCRE, lookaheads work."""
    exact = name.endswith("$")
    return "^(?!" + re.escape(name.rstrip("$")) + ("$" if exact else "") + ")" + regex[1:]


def counts(guest_url: str, service: str) -> dict[str, int]:
    """Ready + unacknowledged messages of each queue of ``service``."""
    return {name: ready + unacked for name, (ready, unacked, _c) in queue_counts(guest_url).items()
            if name.startswith(service + ".")}


def publish(project: Project, key: str) -> None:
    sent = project.run_python(f"from {project.module} import events; events.publish({key!r}, {{'k': {key!r}}})")
    assert sent.returncode == 0, sent.stderr


def test_access_refused_at_run_time_is_one_clear_line_and_loses_nothing(tmp_path, vhost):
    started = time.monotonic()
    runtime_url = url(vhost["runtime"], vhost["password"], vhost["name"])
    guest_url = amqp_url(vhost=vhost["name"])
    project = Project(tmp_path, runtime_url, BODY)
    service, user = project.service, vhost["runtime"]
    try:
        printed = run_cli(project, "permissions", "--user", user)
        assert printed.returncode == 0, printed.stderr
        apply(printed.stdout, user)
        grant = runtime_line(printed.stdout, user).split()[5:8]
        grant = [g.strip("'") for g in grant]
        assert run_cli(project, "--broker", guest_url, "declare").returncode == 0

        def permit(*, write: str = grant[1], read: str = grant[2]) -> None:
            ctl("set_permissions", "-p", vhost["name"], user, grant[0], write, read)

        def refusals(worker) -> list[str]:
            return [line for line in worker.log.splitlines() if "ACCESS_REFUSED" in line]

        # 1. The handler's own publish refused: its PublishError names the permission; retried, then archived.
        permit(write=without(grant[1], project.exchange + "$"))
        worker = project.worker("--events-no-declare").wait_ready(timeout=60)
        guest_publish(project, guest_url, "ar.publish")
        wait_for(lambda: counts(guest_url, service)[f"{service}.archive"] == 1, timeout=30,
                 what="the event whose handler could not publish archived after its retries")
        errors = [r["error"] for r in project.records(handler="publish")]
        print("handler publish errors:", errors)
        assert len(errors) == 3 and all("PublishError" in e and "write" in e and project.exchange in e
                                        for e in errors), errors
        assert not project.records(handler="sink")
        permit()
        publish(project, "ar.sink")  # the worker's channels still work
        wait_for(lambda: project.records(handler="sink"), timeout=20, what="a later event handled")
        purge(guest_url, f"{service}.archive")
        worker.stop()  # RabbitMQ caches a channel's permission checks: a fresh worker for each case

        # 2. A retry refused (no write on the delay exchanges): held, its queue paused, the worker keeps running.
        permit(write=without(grant[1], f"{service}.delay."))
        worker = project.worker("--events-no-declare").wait_ready(timeout=60)
        publish(project, "ar.retry")
        wait_for(lambda: "paused" in worker.log, timeout=30, what="the refused retry")
        time.sleep(2)  # time enough to spin, if it did (it looped ten times a second)
        after = counts(guest_url, service)
        print(f"retry refused: handled={len(project.records(handler='retry'))} refusals={len(refusals(worker))} "
              f"after={after} alive={worker.proc.poll() is None}")
        assert len(project.records(handler="retry")) == 1, worker.log[-4000:]
        assert after[f"{service}.retrying"] == 1 and after[f"{service}.archive"] == 0, after
        assert worker.proc.poll() is None and "Connection to broker lost" not in worker.log, worker.log[-4000:]
        assert_clear_line(worker, f"exchange '{service}.delay.", user)
        publish(project, "ar.sink")  # the other queues go on
        wait_for(lambda: len(project.records(handler="sink")) == 2, timeout=20, what="another queue consumed")
        worker.stop()
        assert "Traceback" not in worker.log, worker.log[-4000:]
        permit()  # granted again, the worker restarted: the message goes on, through its retries to the archive
        worker = project.worker("--events-no-declare").wait_ready(timeout=60)
        wait_for(lambda: counts(guest_url, service)[f"{service}.archive"] == 1, timeout=30, what="retried, archived")
        worker.stop()
        assert counts(guest_url, service)[f"{service}.retrying"] == 0
        purge(guest_url, f"{service}.archive")

        # 3. An archive refused (no write on the archive exchange): the same, and no stripped second copy.
        permit(write=without(grant[1], f"{service}.archive$"))
        worker = project.worker("--events-no-declare").wait_ready(timeout=60)
        publish(project, "ar.archive")
        wait_for(lambda: "paused" in worker.log, timeout=30, what="the refused archive copy")
        time.sleep(2)
        after = counts(guest_url, service)
        print(f"archive refused: handled={len(project.records(handler='archive'))} "
              f"refusals={len(refusals(worker))} after={after} alive={worker.proc.poll() is None}")
        assert len(project.records(handler="archive")) == 1, worker.log[-4000:]
        assert after[f"{service}.archive"] == 0 and after[f"{service}.archiving"] == 1, after
        assert worker.proc.poll() is None and "Connection to broker lost" not in worker.log, worker.log[-4000:]
        assert_clear_line(worker, f"exchange '{service}.archive'", user)
        worker.stop()
        assert "Traceback" not in worker.log, worker.log[-4000:]
        permit()
        worker = project.worker("--events-no-declare").wait_ready(timeout=60)
        wait_for(lambda: counts(guest_url, service)[f"{service}.archive"] == 1, timeout=30, what="archived")
        assert counts(guest_url, service)[f"{service}.archiving"] == 0

        # 4. Read on a handler queue refused after a reconnect: exit 1, one line, nothing lost.
        permit(read=without(grant[2], f"{service}.retrying$"))
        before = counts(guest_url, service)
        ctl("close_all_user_connections", user, "test: reconnect")
        assert worker.wait_exit(timeout=60) == 1, worker.log[-4000:]
        lines = [line for line in worker.log.splitlines() if "permissions` prints" in line]
        print(f"consume refused: lines={lines}")
        assert len(lines) == 1 and f"'{service}.retrying'" in lines[0], worker.log[-4000:]
        assert "Traceback" not in worker.log, worker.log[-4000:]
        assert counts(guest_url, service) == before
    finally:
        for w in project.workers:
            w.kill()
    print(f"access refused: {time.monotonic() - started:.1f} s")


def guest_publish(project: Project, guest_url: str, key: str) -> None:
    """Publish ``key`` to the project's exchange as guest (the runtime user may not)."""
    from .harness import publish_amqp

    publish_amqp(guest_url, project.exchange, key, b'{"k": 1}', content_type="application/json",
                 message_id=uuid.uuid4().hex)


def purge(guest_url: str, queue: str) -> None:
    """Empty ``queue``; the archive (a stream) has its copies settled as purged: no longer counted."""
    if queue.endswith(".archive"):
        purge_archive(guest_url, queue)
    else:
        ctl("purge_queue", "-p", guest_url.rsplit("/", 1)[1], queue)


def assert_clear_line(worker, names: str, user: str) -> None:
    lines = [line for line in worker.log.splitlines() if "ACCESS_REFUSED" in line and "ERROR" in line]
    assert len(lines) == 1, worker.log[-4000:]
    assert names in lines[0] and f"user '{user}'" in lines[0] and "permissions" in lines[0], lines[0]
