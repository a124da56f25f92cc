"""Tracing in a real prefork worker: one trace from the publisher across a failed attempt, its retry and a replay.

The spans are made in the pool's child process, from the context that crossed the
prefork pipe in the message's headers: an in-memory exporter there is out of the
test's reach, so the project's exporter appends each finished span to its records
file (the same SDK, a different exporter). Solo or threads would make the spans in
the worker's main process and prove less.
"""
from __future__ import annotations

import pytest

from .harness import queue_depth, run_cli, wait_for

pytestmark = pytest.mark.integration

PROJECT = """
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult
from kombu_events.tracing import TracingMiddleware


class FileExporter(SpanExporter):
    def export(self, spans):
        for span in spans:
            record(span=span.name, kind=span.kind.name, trace_id=format(span.context.trace_id, "032x"),
                   span_id=format(span.context.span_id, "016x"),
                   parent=format(span.parent.span_id, "016x") if span.parent else None,
                   attributes=dict(span.attributes), status=span.status.status_code.name)
        return SpanExportResult.SUCCESS

    def shutdown(self):
        pass


provider = TracerProvider()
provider.add_span_processor(SimpleSpanProcessor(FileExporter()))
events = Events(app, service=SERVICE, exchange=EXCHANGE, delay_unit_ms=100, delay_levels=4, max_retries=1,
                middleware=[TracingMiddleware(provider)])
FIXED = RECORDS + ".fixed"

@events.handler("orders.*.created", backoff=Constant(every_ms=100))
def charge(payload):
    if not os.path.exists(FIXED):
        raise ConnectionError("payment service down")
"""


def test_one_trace_spans_every_attempt_and_the_replay(make_project):
    project = make_project(PROJECT)
    worker = project.worker(pool="prefork", concurrency=1).wait_ready()
    archive = f"{project.service}.archive"

    published = project.run_python(f"""
        from {project.module} import events
        print(events.publish("orders.7.created", {{"order_id": 7}}, correlation_id="order-7"))
    """)
    assert published.returncode == 0, published.stderr
    message_id = published.stdout.strip()
    wait_for(lambda: queue_depth(project.broker_url, archive)[0] == 1, what="the message archived after 2 attempts")
    (project.dir / f"{project.module}.records.fixed").write_text("")
    replay = run_cli(project, "archive", "replay")
    assert replay.returncode == 0, replay.stdout + replay.stderr
    wait_for(lambda: len(project.records(kind="CONSUMER")) == 3, what="the replayed attempt")

    (producer,) = project.records(kind="PRODUCER")
    attempts = project.records(kind="CONSUMER")
    assert producer["span"] == f"publish {project.exchange}"
    assert [a["span"] for a in attempts] == [f"process {project.service}.charge"] * 3
    assert {a["trace_id"] for a in attempts} == {producer["trace_id"]}
    assert {a["parent"] for a in attempts} == {producer["span_id"]}
    assert [a["attributes"]["kombu_events.attempt"] for a in attempts] == [1, 2, 1]
    assert [a["attributes"].get("error.type") for a in attempts] == ["ConnectionError", "ConnectionError", None]
    assert [a["status"] for a in attempts] == ["ERROR", "ERROR", "UNSET"]
    assert {a["pid"] for a in attempts}.isdisjoint({worker.proc.pid, producer["pid"]}), "made in the pool child"
    for a in attempts:
        assert a["attributes"]["messaging.system"] == "rabbitmq"
        assert a["attributes"]["messaging.operation.type"] == "process"
        assert a["attributes"]["messaging.destination.name"] == (
            f"{project.exchange}:orders.7.created:{project.service}.charge")
        assert a["attributes"]["messaging.rabbitmq.destination.routing_key"] == "orders.7.created"
        assert a["attributes"]["messaging.message.id"] == message_id
        assert a["attributes"]["messaging.message.conversation_id"] == "order-7"
