"""The middleware and signal seam in a real prefork worker: who sees what, in which process."""
from __future__ import annotations

import json

import pytest

from .harness import publish_amqp, queue_counts, unique, wait_for

pytestmark = pytest.mark.integration

SEAM = """
from kombu_events import Middleware, Outcome, signals
from kombu_events.core.decision import DEFERRED

class Recorder(Middleware):
    def __init__(self):
        self.deferred = set()

    def received(self, delivery):
        record(hook="received", message_id=delivery.message_id, attempt=delivery.attempt)

    def before_dispatch(self, delivery):
        if delivery.headers.get("defer-once") and delivery.message_id not in self.deferred:
            self.deferred.add(delivery.message_id)
            return Outcome(DEFERRED, "deferred by the test", delay_ms=200)
        return None

    def handling(self, event):
        record(hook="handling", message_id=event.message_id, queue=event.queue, routing_key=event.routing_key)
        return super().handling(event)

    def settled(self, delivery, outcome, step):
        record(hook="settled", message_id=delivery.message_id, action=step.action, kind=outcome.kind,
               duration_ms=outcome.duration_ms)

    def before_publish(self, exchange, routing_key, properties):
        properties["application_headers"]["traceparent"] = "00-" + "1" * 32 + "-" + "2" * 16 + "-01"


class Broken(Middleware):
    def received(self, delivery):
        raise RuntimeError("broken received hook")

    def before_dispatch(self, delivery):
        raise RuntimeError("broken before_dispatch hook")

    def handling(self, event):
        raise RuntimeError("broken handling hook")

    def settled(self, delivery, outcome, step):
        raise RuntimeError("broken settled hook")


events = Events(app, service=SERVICE, exchange=EXCHANGE, delay_unit_ms=100, delay_levels=8,
                middleware=[Broken(), Recorder()])

@events.handler("jobs.#", max_retries=0)
def job(payload):
    time.sleep(payload.get("sleep", 0))
    if payload.get("fail"):
        raise ValueError("job failed")

@signals.handler_failed.connect(sender=job)
def on_failed(sender, event, exception, traceback, duration_ms, **kwargs):
    record(hook="handler_failed", message_id=event.message_id, exception=repr(exception),
           has_traceback=traceback is not None)

@signals.message_settled.connect
def on_settled(sender, queue, routing_key, message_id, attempt, action, delay_ms, reason, handler_duration_ms,
               **kwargs):
    record(hook="message_settled", message_id=message_id, action=action, queue=queue, routing_key=routing_key,
           handler_duration_ms=handler_duration_ms, sender=sender.__name__)

@signals.event_published.connect
def on_published(sender, exchange, routing_key, message_id, properties, error, **kwargs):
    record(hook="event_published", message_id=message_id, error=repr(error),
           traceparent=properties["application_headers"].get("traceparent"))
"""


def test_middleware_and_signals_see_each_message_in_the_right_process(make_project):
    project = make_project(SEAM)
    worker = project.worker(pool="prefork", concurrency=2).wait_ready()

    def send(payload: dict, **headers: object) -> str:
        message_id = unique("m")
        publish_amqp(project.broker_url, project.exchange, "jobs.1", json.dumps(payload).encode(),
                     message_id=message_id, content_type="application/json", application_headers=headers)
        return message_id

    ok, failed, deferred = send({"sleep": 0.05}), send({"fail": True}), send({}, **{"defer-once": True})
    wait_for(lambda: len(project.records(hook="message_settled")) >= 4, what="every message settled")

    def seen(message_id: str, hook: str) -> list[dict]:
        return project.records(message_id=message_id, hook=hook)

    main_pid = worker.proc.pid
    [settled] = seen(ok, "settled")
    assert (settled["action"], settled["kind"], settled["pid"]) == ("ack", "ok", main_pid)
    assert 50 <= settled["duration_ms"] < 1000, "the handler's own time, measured in the pool"
    [handling] = seen(ok, "handling")
    assert handling["pid"] != main_pid and handling["routing_key"] == "jobs.1"
    assert handling["queue"] == f"{project.service}.job"
    [signal] = seen(ok, "message_settled")
    assert (signal["action"], signal["sender"], signal["pid"]) == ("ack", "job", main_pid)

    [failure] = seen(failed, "handler_failed")
    assert "job failed" in failure["exception"] and failure["has_traceback"] and failure["pid"] != main_pid
    assert [r["action"] for r in seen(failed, "settled")] == ["archive"]

    assert [r["action"] for r in seen(deferred, "settled")] == ["requeue", "ack"]
    assert [r["attempt"] for r in seen(deferred, "received")] == [1, 1], "a deferral spends no attempt"
    assert len(seen(deferred, "handling")) == 1

    assert worker.log.count("broken received hook") >= 4 and "broken settled hook" in worker.log
    assert queue_counts(project.broker_url)[f"{project.service}.job"][:2] == (0, 0)

    result = project.run_python(f"""
        from {project.module} import events
        events.publish("jobs.2", {{"n": 2}})
    """)
    assert result.returncode == 0, result.stderr
    [published] = wait_for(lambda: project.records(hook="event_published"), what="event_published")
    assert published["error"] == "None" and published["traceparent"].startswith("00-111")
    wait_for(lambda: len(project.records(hook="message_settled")) >= 5, what="the published event handled")
